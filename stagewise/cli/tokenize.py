"""``stagewise tokenize``: a corpus into a token file that training reads a window at a time, with a progress bar."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from stagewise.cli import args
from stagewise.cli.commands import COMMANDS
from stagewise.run.documents import Fields, files
from stagewise.run.token_file import write_token_file
from stagewise.run.tokenizer import BYTES, load_tokenizer


def add(commands: Any) -> None:
    p = commands.add_parser(
        "tokenize",
        help=COMMANDS["tokenize"].help,
        description="Tokenize text files or folders, JSON lines (a field), Parquet or CSV (a column), or a folder "
        "Hugging Face datasets saved with save_to_disk (a column; a DatasetDict's train split) into a token file: "
        "each document's ids and an end-of-text token, uint16 or uint32 by vocabulary size, with the bounds of "
        "its documents; train --data reads it a window at a time.",
    )
    p.add_argument("--data", required=True, help="text files or folders, .jsonl, .parquet, .csv, a saved dataset")
    p.add_argument("--tokenizer", default=BYTES, help="a Hugging Face tokenizer's folder, or bytes")
    p.add_argument("--out", type=Path, required=True, help="the token file's folder")
    p.add_argument("--data-field", default="text", help="the field of a JSON line that holds the text")
    p.add_argument("--data-column", default="text", help="the column that holds the text (Parquet, CSV, a dataset)")
    p.add_argument(
        "--workers", type=args.positive_int, default=min(4, os.cpu_count() or 1),
        help="processes that tokenize in parallel, in order",
    )  # fmt: skip


def run(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    tokenizer = load_tokenizer(ns.tokenizer)
    total = sum(p.stat().st_size for p in files(Path(ns.data)))
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not sys.stderr.isatty()) as bar:
        meta = write_token_file(
            ns.data, tokenizer, ns.out, fields=Fields(ns.data_field, ns.data_column), workers=ns.workers,
            progress=bar.update,
        )  # fmt: skip
    print(
        f"wrote {ns.out}: {meta.tokens} tokens ({meta.dtype}) in {meta.documents} documents, vocabulary "
        f"{meta.vocab_size}, end-of-text {meta.eos_id}, tokenizer {meta.tokenizer}",
        flush=True,
    )
    return 0
