"""Shared pytest setup: one intra-op thread per process, and tests/ importable for the multiproc helper."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
