"""Process groups and device mesh, the local launcher, and the transport between stages with its wires.

What users call is listed in ``__all__``; everything else is importable from the module that defines it.
"""

from stagewise.comm.errors import CommError, CommTimeoutError, PeerGoneError
from stagewise.comm.launch_failures import LaunchError
from stagewise.comm.launch_options import LaunchOptions
from stagewise.comm.launcher import launch
from stagewise.comm.layout import Layout
from stagewise.comm.mesh import PipelineMesh, init_mesh
from stagewise.comm.transport import Transport

# isort: split
# Imported here, aliased as themselves, for other stagewise packages that still read them from stagewise.comm; not
# public (not in __all__): import each from the module that defines it.
from stagewise.comm.agreement import everyone_agrees as everyone_agrees  # checkpoint/loading.py, run/resume.py
from stagewise.comm.default_group import world_group as world_group  # pipeline/pipe.py
from stagewise.comm.errors import named_collective as named_collective  # pipeline/
from stagewise.comm.meta import TensorMeta as TensorMeta  # pipeline/gradients.py
from stagewise.comm.payload import Payload as Payload  # pipeline/, plan/, cli/
from stagewise.comm.payload import PayloadLayout as PayloadLayout  # pipeline/
from stagewise.comm.payload import as_tensors as as_tensors  # pipeline/, plan/
from stagewise.comm.receiving import Receiving as Receiving  # pipeline/posted_receives.py

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
