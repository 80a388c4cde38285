"""A small corpus and a BPE tokenizer trained on it, made here (nothing is downloaded): the standard library's
source as JSON lines, and a Llama config whose vocabulary is the tokenizer's."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def texts(count: int) -> list[str]:
    """The source of the first ``count`` modules of the standard library, in name order."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]
    return [f.read_text(errors="replace") for f in files]


def write_json_lines(path: Path, documents: list[str], field: str = "text") -> Path:
    with path.open("w") as out:
        for text in documents:
            out.write(json.dumps({field: text, "source": "stdlib"}) + "\n")
    return path


def bpe_folder(folder: Path, documents: list[str], vocab: int, *, model_vocab: int | None = None) -> Path:
    """A Hugging Face folder: a byte-level BPE tokenizer of ``vocab`` tokens trained on ``documents``, and a tiny
    Llama config whose vocabulary is ``model_vocab`` (the tokenizer's by default)."""
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(documents, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS)
    fast.save_pretrained(folder)
    transformers.LlamaConfig(
        vocab_size=model_vocab or len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
    ).save_pretrained(folder)  # fmt: skip
    return folder
