"""Process groups and device mesh, the local launcher, and the transport between stages with its wires."""

from stagewise.comm.agreement import everyone_agrees
from stagewise.comm.default_group import Backend, choose_backend, world_group
from stagewise.comm.errors import CommError, CommTimeoutError, PeerGoneError, collective_failed, named_collective
from stagewise.comm.launch_failures import LaunchError, RankFailure
from stagewise.comm.launch_options import LaunchOptions, StartMethod
from stagewise.comm.launcher import free_port, launch, launch_module
from stagewise.comm.layout import Coords, Layout
from stagewise.comm.mesh import PipelineMesh, init_mesh
from stagewise.comm.meta import TensorMeta
from stagewise.comm.payload import Payload, PayloadLayout, as_tensors
from stagewise.comm.receiving import Receiving
from stagewise.comm.transport import Transport
from stagewise.comm.waits import Pending
from stagewise.comm.wire import Wire

__all__ = [
    "Backend",
    "CommError",
    "CommTimeoutError",
    "Coords",
    "LaunchError",
    "LaunchOptions",
    "Layout",
    "Payload",
    "PayloadLayout",
    "PeerGoneError",
    "Pending",
    "PipelineMesh",
    "RankFailure",
    "Receiving",
    "StartMethod",
    "TensorMeta",
    "Transport",
    "Wire",
    "as_tensors",
    "choose_backend",
    "collective_failed",
    "everyone_agrees",
    "free_port",
    "init_mesh",
    "launch",
    "launch_module",
    "named_collective",
    "world_group",
]
