from odcfn.kernels.base import (
    Collectives,
    Counters,
    Done,
    Handle,
    PointToPoint,
    Transport,
    TransportError,
    supports_odc,
)
from odcfn.kernels.collective import CollectiveTransport, TorchCollectives
from odcfn.kernels.cuda_ipc import cuda_ipc_transport
from odcfn.kernels.local import LocalCollectives, LocalWorld, run_local
from odcfn.kernels.nvshmem import nvshmem_transport
from odcfn.kernels.shm import ShmTransport

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
