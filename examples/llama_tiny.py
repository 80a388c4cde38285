"""A small Llama trained end to end with nothing downloaded: its tokenizer, its config, the run, and a sample.

    python examples/llama_tiny.py prepare                      # a BPE tokenizer and a Llama config: a model folder
    python -m stagewise train --config examples/llama-tiny.toml
    python examples/llama_tiny.py sample                       # the export, from_pretrained, generate, decode

``prepare`` writes the corpus (the installed Python standard library's source, one document per module, as
JSON lines), trains a byte-level BPE tokenizer on it with ``tokenizers``, and saves that tokenizer with a small
Llama config as a Hugging Face folder. ``train`` then reads the folder as ``hf:DIR``: it tokenizes the corpus
with the folder's tokenizer, and initialises the model from its config. ``sample`` exports the run's latest
checkpoint as a folder that ``from_pretrained`` loads, and decodes what the model generates.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

HERE = Path("stagewise-run/llama-tiny")
"""Where ``prepare`` writes, and what ``examples/llama-tiny.toml`` names (relative to the working folder)."""
EOS = "<|endoftext|>"


def corpus(out: Path, limit: int) -> Path:
    """The standard library's modules, in name order, as JSON lines (``{"text": ...}``), at most ``limit`` bytes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with out.open("w", encoding="utf-8") as lines:
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            if written + len(text) > limit:
                break
            lines.write(json.dumps({"text": text}) + "\n")
            written += len(text)
    return out


def tokenizer(texts: list[str], vocab: int, folder: Path) -> int:
    """Train a byte-level BPE tokenizer of ``vocab`` tokens on ``texts`` and save it into ``folder``; its size."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS)
    fast.save_pretrained(folder)
    return len(fast)


def prepare(ns: argparse.Namespace) -> None:
    import transformers

    data = corpus(ns.out / "corpus.jsonl", ns.limit)
    texts = [json.loads(line)["text"] for line in data.read_text(encoding="utf-8").splitlines()]
    folder = ns.out / "model"
    size = tokenizer(texts, ns.vocab, folder)
    eos = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True).eos_token_id
    config = transformers.LlamaConfig(
        vocab_size=size, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=eos, eos_token_id=eos,
        tie_word_embeddings=False,
    )  # fmt: skip
    config.save_pretrained(folder)
    print(f"wrote {data} ({len(texts)} documents) and {folder} (a {size}-token BPE tokenizer, a Llama config)")


def sample(ns: argparse.Namespace) -> None:
    import torch
    import transformers

    from stagewise import checkpoint

    run = ns.run.resolve()
    latest = checkpoint.latest(run / "checkpoints")
    if latest is None:
        raise SystemExit(f"no checkpoint in {run / 'checkpoints'}: train first (or give --run)")
    folder = ns.out / "model"
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    exported = checkpoint.export(latest, run / "export", format="hf", config=config)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    torch.manual_seed(0)
    prompt = tok(ns.prompt, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(
            **prompt, max_new_tokens=ns.tokens, do_sample=True, top_k=20, pad_token_id=tok.eos_token_id
        )
    print(f"exported {latest.name} to {exported}; a sample:")
    print(tok.decode(ids[0], skip_special_tokens=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help=f"where the corpus and the model folder go ({HERE})")
    steps = parser.add_subparsers(dest="step", required=True)
    made = steps.add_parser("prepare", help="write the corpus, train the tokenizer, save the model folder")
    made.add_argument("--limit", type=int, default=8 << 20, help="bytes of the corpus at most (8 MiB)")
    made.add_argument("--vocab", type=int, default=8192, help="tokens of the BPE tokenizer")
    drawn = steps.add_parser("sample", help="export the latest checkpoint and decode a sample of it")
    drawn.add_argument("--run", type=Path, default=Path("stagewise-run/latest"), help="the run's folder")
    drawn.add_argument("--prompt", default="def ", help="the text the sample continues")
    drawn.add_argument("--tokens", type=int, default=40, help="tokens to generate")
    ns = parser.parse_args()
    prepare(ns) if ns.step == "prepare" else sample(ns)


if __name__ == "__main__":
    main()
