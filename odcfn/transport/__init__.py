from odcfn.transport.base import (
    Collectives,
    Counters,
    Done,
    Handle,
    PointToPoint,
    Transport,
    TransportError,
    supports_odc,
)
from odcfn.transport.collective import CollectiveTransport, TorchCollectives
from odcfn.transport.gpu.cuda_ipc import cuda_ipc_transport
from odcfn.transport.gpu.nvshmem import nvshmem_transport
from odcfn.transport.local import LocalCollectives, LocalWorld, run_local
from odcfn.transport.shm import ShmTransport

__all__ = [
    "CollectiveTransport",
    "Collectives",
    "Counters",
    "Done",
    "Handle",
    "LocalCollectives",
    "LocalWorld",
    "PointToPoint",
    "ShmTransport",
    "TorchCollectives",
    "Transport",
    "TransportError",
    "cuda_ipc_transport",
    "nvshmem_transport",
    "run_local",
    "supports_odc",
]
