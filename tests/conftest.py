"""Shared pytest setup: one intra-op thread per process, reproducible hypothesis runs under CI, shared runs."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings
from support.training import Runs, reference_runs

torch.set_num_threads(1)

# No hypothesis deadline: the suite's two workers share the cores (see pyproject.toml), so how long one example
# took says nothing about the code. CI runs the same examples every time (a failure there reproduces exactly);
# local runs explore.
settings.register_profile("suite", deadline=None)
settings.register_profile("ci", parent=settings.get_profile("suite"), derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "suite")


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """An uninterrupted 8-step run, and a 4-step run whose checkpoint the tests resume from (trained once)."""
    return reference_runs(tmp_path_factory.mktemp("train"))
