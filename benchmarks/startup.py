"""How soon each command shows its first line: seconds from starting ``python -m stagewise ...`` to its first line
of output, against ``python -c "import torch"`` timed in the same run (the floor of any command that needs torch).

One JSON line per command: the median of ``--repeats`` runs, and its ratio to torch's import. ``train`` runs the
default job and is stopped once its first line is out.

    python benchmarks/startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

COMMANDS: dict[str, list[str]] = {
    "--help": ["--help"],
    "schedule 1f1b": ["schedule", "1f1b", "--stages", "4", "--microbatches", "8"],
    "tokenize --help": ["tokenize", "--help"],
    "train --help": ["train", "--help"],
    "plan --help": ["plan", "--help"],
    "partition --help": ["partition", "--help"],
    "nodes --help": ["nodes", "--help"],
    "train (first line)": ["train", "--steps", "3", "--eval-every", "0", "--no-checkpoints"],
}


def first_line(argv: list[str]) -> float:
    """Seconds until ``argv``'s first line of output; the process is stopped then."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    process.stdout.readline()
    seconds = time.perf_counter() - start
    process.kill()
    process.wait()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()
    torch_import = statistics.median(
        first_line([sys.executable, "-c", "import torch; print()"]) for _ in range(ns.repeats)
    )
    print(json.dumps({"bench": "startup", "command": "import torch", "seconds": round(torch_import, 3)}), flush=True)
    for name, words in COMMANDS.items():
        seconds = statistics.median(first_line([sys.executable, "-m", "stagewise", *words]) for _ in range(ns.repeats))
        row = {"bench": "startup", "command": name, "seconds": round(seconds, 3)}
        print(json.dumps(row | {"x_torch_import": round(seconds / torch_import, 2)}), flush=True)


if __name__ == "__main__":
    main()
