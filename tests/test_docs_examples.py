"""Every ```python and ```bash block of README.md and docs/**/*.md runs as written.

A Python block runs as a script of its own in a fresh interpreter, in a temporary folder; a bash block runs
command by command there (a line ending in a backslash continues on the next; ``#`` starts a comment).
``python`` in a bash block is this interpreter. A block that cannot run here is marked by the line right
before its fence, ``<!-- example: skip (the reason) -->``, and reported as a skip with that reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
SKIP = re.compile(r"^\s*<!-- example: skip \((?P<reason>.+)\) -->\s*$")
LANGUAGES = ("python", "bash")
TIMEOUT = 120.0  # seconds, for one block or one command


@dataclass(frozen=True)
class Example:
    """One fenced block: where it is, its language, its text, and why it is skipped (if it is)."""

    path: Path
    line: int
    language: str
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def documents() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def examples_in(path: Path) -> list[Example]:
    """The fenced blocks of one file, with the skip marker that precedes each (if any)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening or not opening["lang"]:
            i += 1
            continue
        indent, language = len(opening["indent"]), opening["lang"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if language in LANGUAGES:
            marker = SKIP.match(lines[i - 1]) if i > 0 else None
            code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            found.append(Example(path, i + 1, language, code, marker["reason"] if marker else None))
        i = end + 1
    return found


def all_examples() -> list[Example]:
    return [example for path in documents() for example in examples_in(path)]


def commands(code: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        command = re.sub(r"(^|\s)#.*$", "", line).strip()
        if command:
            out.append(command)
    return out


def environment() -> dict[str, str]:
    """This interpreter first on PATH, so ``python`` is it; the examples run on the CPU."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run(argv: list[str] | str, cwd: Path, what: str) -> str | None:
    """Run one command; None when it succeeds, else what went wrong with its output."""
    try:
        done = subprocess.run(
            argv,
            cwd=cwd,
            env=environment(),
            shell=isinstance(argv, str),
            executable="/bin/bash" if isinstance(argv, str) else None,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        return f"{what} ran past {TIMEOUT:.0f} s\n{error.stdout!r}\n{error.stderr!r}"
    if done.returncode != 0:
        return f"{what} exited {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return None


def execute(example: Example) -> str | None:
    """Run one example in a temporary folder of its own; None when it succeeds, else why it failed."""
    with tempfile.TemporaryDirectory(prefix="stagewise-example-") as folder:
        cwd = Path(folder)
        if example.language == "python":
            script = cwd / "example.py"
            script.write_text(example.code, encoding="utf-8")
            return run([sys.executable, str(script)], cwd, f"the example at {example.id}")
        for command in commands(example.code):
            failure = run(command, cwd, f"`{command}` of the example at {example.id}")
            if failure is not None:
                return failure
        return None


def weight(example: Example) -> int:
    """A rough rank of how long an example runs: processes it starts, then commands."""
    processes = example.code.count("launch(") + example.code.count("stagewise train")
    return 10 * processes + len(commands(example.code)) if example.language == "bash" else 10 * processes


EXAMPLES = all_examples()


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[str | None]]]:
    """The selected examples, started two at a time as soon as the first is asked for.

    Most of an example's time is one process importing torch, or ranks waiting on each other, so two at once
    take about half the time of one after another, even beside the suite's other worker.
    """
    selected = [
        item.callspec.params["example"]
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.module is sys.modules[__name__]
        and hasattr(item, "callspec")
        and "example" in item.callspec.params
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runnable = sorted((e for e in selected if e.skip is None), key=lambda e: -weight(e))  # the longest first
        futures = {example.id: pool.submit(execute, example) for example in runnable}
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.mark.parametrize("example", EXAMPLES, ids=[example.id for example in EXAMPLES])
def test_example_runs_as_written(example: Example, outcomes: dict[str, Future[str | None]]) -> None:
    if example.skip is not None:
        pytest.skip(f"{example.id}: {example.skip}")
    failure = outcomes[example.id].result()
    if failure is not None:
        pytest.fail(failure)


def test_the_collector_finds_every_block() -> None:
    """Each fence of a Python or bash block is collected once, and each skip marker precedes such a block."""
    for path in documents():
        lines = path.read_text(encoding="utf-8").splitlines()
        fences = sum(1 for line in lines if re.match(r"^ *```(python|bash)\s*$", line))
        assert fences == len(examples_in(path)), path
        for i, line in enumerate(lines):
            if SKIP.match(line):
                assert i + 1 < len(lines) and re.match(r"^ *```(python|bash)\s*$", lines[i + 1]), (
                    f"{path}:{i + 1}: a skip marker must be the line right before a python or bash block"
                )
