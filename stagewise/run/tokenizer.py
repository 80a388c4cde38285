"""Tokenizers a run reads text with: bytes (the presets' default), or a Hugging Face tokenizer from a local folder.

A Hugging Face tokenizer is loaded with ``AutoTokenizer`` from local files
only and without ``trust_remote_code``: a folder whose tokenizer needs code
of its own is refused, nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

BYTES = "bytes"
"""The name of the byte-level tokenizer: each byte is a token (256 of them)."""


class Tokenizer(Protocol):
    """What a run needs of a tokenizer."""

    @property
    def name(self) -> str:
        """``bytes``, or the folder it was loaded from (what a token file records)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to this, exclusive."""
        ...

    @property
    def eos_id(self) -> int:
        """The end-of-text token joining documents."""
        ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """Each UTF-8 byte is a token; documents are joined by byte 0, which text does not hold."""

    name: str = BYTES
    vocab_size: int = 256
    eos_id: int = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A Hugging Face tokenizer from a local folder (``tokenizer.json`` or the files its class reads)."""

    def __init__(self, folder: str | Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ImportError(f"the tokenizer {folder} needs transformers: pip install transformers") from err
        self.name = str(folder)
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"cannot load a tokenizer from {folder} ({type(err).__name__}: {str(err).splitlines()[0]}); give a "
                "folder that save_pretrained wrote a tokenizer into (tokenizer.json), or --tokenizer bytes"
            ) from err
        eos = self._tok.eos_token_id
        if eos is None:
            raise ValueError(
                f"the tokenizer {folder} has no end-of-text token (eos_token), which joins documents; set one "
                "(tokenizer.eos_token = ...) and save it again"
            )
        self.eos_id = int(eos)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` (a Hugging Face model folder) holds a tokenizer of its own."""
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def load_tokenizer(name: str | Path) -> Tokenizer:
    """``bytes``, or the Hugging Face tokenizer in the folder ``name``."""
    if str(name) == BYTES:
        return ByteTokenizer()
    folder = Path(name)
    if not folder.is_dir():
        raise ValueError(f"the tokenizer {name} is neither 'bytes' nor a folder; give a tokenizer's folder or bytes")
    return HFTokenizer(folder)


def check_fits(tokenizer_vocab: int, model_vocab: int | None, tokenizer: str, model: str) -> None:
    """Refuse data whose token ids the model has no embedding for."""
    if model_vocab is not None and tokenizer_vocab > model_vocab:
        raise ValueError(
            f"the tokenizer {tokenizer} has {tokenizer_vocab} tokens, more than the {model_vocab} that {model} "
            "embeds; train it with its own tokenizer (--tokenizer DIR), or a model whose vocabulary holds it"
        )
