"""Argument types and checks shared by the commands: sizes, number lists, counts, devices, per-stage values.

It imports no torch (each check that needs it imports it when it runs), so that a command's help is quick.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Literal

from stagewise.units import parse_bytes


def size(text: str) -> float:
    """Bytes, as ``parse_bytes`` reads them; its message reaches the user (argparse hides a ValueError's)."""
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def sizes(text: str) -> list[float]:
    return [size(part) for part in text.split(",")]


def floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from err


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from err
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def seed(text: str) -> int:
    """A seed every rank can use (:data:`stagewise.run.config.SEEDS`), refused here with the range."""
    from stagewise.run.config import check_seed

    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from err
    try:
        return check_seed(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("seed ")) from err


def model_name(text: str) -> str:
    """A model a run can train (see :func:`stagewise.run.user_model.model_of`), refused here with the choices."""
    from stagewise.run.user_model import model_of

    try:
        model_of(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix(f"--model {text}: ")) from err
    return text


def bounds(text: str) -> tuple[int, ...]:
    """Stage bounds of the layers, ``0,3,7``: whole numbers from 0, increasing."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers such as 0,3,7, got {text!r}") from err
    if len(values) < 2 or values[0] != 0 or any(b <= a for a, b in itertools.pairwise(values)):
        raise argparse.ArgumentTypeError(
            f"{text} are not stage bounds: give whole numbers from 0 that increase, such as 0,3,7 (layers 0-2 and 3-6)"
        )
    return values


def per_stage(values: list[float] | None, n_stages: int, what: str) -> list[float] | None:
    if values is None or len(values) == n_stages:
        return values
    if len(values) == 1:
        return values * n_stages
    raise ValueError(f"--{what} has {len(values)} values for {n_stages} stages; give one, or one per stage")


def pool(text: str) -> int | Literal["free"]:
    """A weight-gradient pool: a number of backwards >= 1, or "free"."""
    if text == "free":
        return "free"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1 or 'free', got {text}") from None


def device(text: str) -> str:
    """A torch device this machine has (``cpu``, ``cuda``, ``cuda:1``, ...)."""
    import torch

    try:
        parsed = torch.device(text)
    except RuntimeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda or cuda:N") from err
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text} is not available here: this torch has no CUDA device to use")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text} does not exist: this machine has {torch.cuda.device_count()} GPUs")
    return text


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the option's own help names it or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"
