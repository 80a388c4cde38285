"""How fast a token file feeds training, and what a large one costs in memory.

1. Loader speed: rank 0's ``StageLoader`` (a stage that holds both ends, as a single-stage run's does) over a
   token file, shuffled, in the default run's batches (16 sequences of 128 tokens): tokens per second, against
   the tokens per second the default run trains (``--reference``, from its ``metrics.jsonl``; 2.0e4 here).
2. Memory: ``train`` of gpt-tiny on 2 local processes for ``--steps`` steps on a ``--size`` token file of random
   ids (2 GiB by default) and on a small one (4 MiB); each rank's peak resident memory from ``metrics.jsonl``.
   The growth is the large file's over the small's: the map's pages touched and the shuffle's order.

    python benchmarks/token_data.py [--size 2GiB] [--steps 50] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from stagewise.pipeline import LoaderOptions, StageLoader
from stagewise.run.token_file import INDEX, META, TOKENS, TokenFile, TokenFileMeta
from stagewise.run.token_windows import TokenWindows
from stagewise.units import parse_bytes

BATCH, SEQ = 16, 128


def random_token_file(folder: Path, nbytes: int, vocab: int = 256) -> Path:
    """A token file of ``nbytes`` of uint16 ids drawn at random, one document, written a chunk at a time."""
    folder.mkdir(parents=True)
    count = nbytes // 2
    rng = np.random.default_rng(0)
    chunk = 1 << 24
    with (folder / TOKENS).open("wb") as out:
        for start in range(0, count, chunk):
            out.write(rng.integers(1, vocab, min(chunk, count - start), dtype=np.uint16).tobytes())
    np.asarray([0, count], dtype=np.uint64).tofile(folder / INDEX)
    meta = TokenFileMeta("uint16", count, 1, vocab, 0, "bytes")
    (folder / META).write_text(json.dumps(meta.__dict__))
    return folder


def loader_speed(folder: Path, batches: int = 400) -> float:
    """Tokens per second that a shuffled loader over ``folder`` hands out (inputs and targets, int64)."""
    loader = StageLoader(
        TokenWindows(TokenFile(folder), SEQ), global_batch_size=BATCH, dp=1, replica=0, first=True, last=True,
        n_microbatches=4, options=LoaderOptions(seed=0),
    )  # fmt: skip
    loader.set_epoch(0)
    began = time.perf_counter()
    for _, _batch in zip(range(batches), loader, strict=False):
        pass
    return batches * BATCH * SEQ / (time.perf_counter() - began)


def peak_memory(folder: Path, steps: int, work: Path) -> list[int]:
    """Each rank's peak resident memory at the end of ``steps`` steps of gpt-tiny on the token file ``folder``."""
    out = work / f"run-{folder.name}"
    argv = [sys.executable, "-m", "stagewise", "train", "--data", str(folder), "--steps", str(steps)]
    argv += ["--eval-every", "0", "--eval-batches", "1", "--no-checkpoints", "--out", str(out)]
    subprocess.run(argv, check=True, capture_output=True, cwd=work, timeout=600)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [int(v) for v in [r for r in records if "peak_memory" in r][-1]["peak_memory"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("2GiB"), help="the large token file")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reference", type=float, default=2.0e4, help="tokens/s the default run trains")
    parser.add_argument("--dir", default=None, help="where the token files go (default: a temporary folder)")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=ns.dir) as root:
        work = Path(root)
        large = random_token_file(work / "large", int(ns.size))
        small = random_token_file(work / "small", 4 << 20)
        speed = loader_speed(large)
        print(json.dumps({"loader_tokens_s": round(speed), "ratio_to_training": round(speed / ns.reference, 1)}))
        grown = [
            a - b for a, b in zip(peak_memory(large, ns.steps, work), peak_memory(small, ns.steps, work), strict=True)
        ]
        print(
            json.dumps(
                {
                    "token_file_bytes": int(ns.size),
                    "steps": ns.steps,
                    "rss_growth_mib": [round(g / 2**20, 1) for g in grown],
                }
            )
        )


if __name__ == "__main__":
    main()
