"""Process groups and device mesh, the local launcher, and the transport between stages with its wires.

What users call is listed in ``__all__``; everything else is importable from the module that defines it.

The names load on first use, so that importing one module of the package loads only what it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagewise.comm.errors import CommError, CommTimeoutError, PeerGoneError
    from stagewise.comm.launch_failures import LaunchError
    from stagewise.comm.launch_options import LaunchOptions
    from stagewise.comm.launcher import launch
    from stagewise.comm.layout import Layout
    from stagewise.comm.mesh import PipelineMesh, init_mesh
    from stagewise.comm.transport import Transport

_HOMES = {
    "CommError": "stagewise.comm.errors",
    "CommTimeoutError": "stagewise.comm.errors",
    "PeerGoneError": "stagewise.comm.errors",
    "LaunchError": "stagewise.comm.launch_failures",
    "LaunchOptions": "stagewise.comm.launch_options",
    "launch": "stagewise.comm.launcher",
    "Layout": "stagewise.comm.layout",
    "PipelineMesh": "stagewise.comm.mesh",
    "init_mesh": "stagewise.comm.mesh",
    "Transport": "stagewise.comm.transport",
}
"""Where each name lives."""

__all__ = [
    "CommError",
    "CommTimeoutError",
    "LaunchError",
    "LaunchOptions",
    "Layout",
    "PeerGoneError",
    "PipelineMesh",
    "Transport",
    "init_mesh",
    "launch",
]


def __getattr__(name: str) -> Any:
    """Load one of the names above from its module when it is first asked for."""
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'stagewise.comm' has no attribute {name!r}")
