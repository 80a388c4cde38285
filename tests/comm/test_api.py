"""comm's internals, unexported (tests/test_public_api.py lists what it exports), are importable from their modules."""

from __future__ import annotations

import importlib

from stagewise import comm

INTERNAL = {
    "stagewise.comm.agreement": ["everyone_agrees"],
    "stagewise.comm.default_group": ["Backend", "choose_backend", "world_group"],
    "stagewise.comm.errors": ["collective_failed", "named_collective"],
    "stagewise.comm.launch_failures": ["RankFailure"],
    "stagewise.comm.launch_options": ["StartMethod"],
    "stagewise.comm.launcher": ["free_port", "launch_module"],
    "stagewise.comm.layout": ["Coords"],
    "stagewise.comm.meta": ["TensorMeta"],
    "stagewise.comm.payload": ["Payload", "PayloadLayout", "as_tensors"],
    "stagewise.comm.receiving": ["Receiving"],
    "stagewise.comm.waits": ["Pending"],
    "stagewise.comm.wire": ["Wire"],
}
"""Names stagewise.comm exported before it listed only what users call, and where each lives now."""


def test_the_internals_are_importable_from_their_modules() -> None:
    for module, names in INTERNAL.items():
        loaded = importlib.import_module(module)
        for name in names:
            assert hasattr(loaded, name), f"{module} has no {name}"
            assert name not in comm.__all__
