"""Shared pytest setup: one intra-op thread per process, and reproducible hypothesis runs under CI."""

from __future__ import annotations

import os

import torch
from hypothesis import settings

torch.set_num_threads(1)

# CI runs the same examples every time (a failure there reproduces exactly); local runs explore.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
