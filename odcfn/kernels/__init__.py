from odcfn.kernels.base import Counters, Done, Handle, Transport, TransportError
from odcfn.kernels.collective import CollectiveTransport
from odcfn.kernels.cuda_ipc import TorchCollectives, cuda_ipc_transport
from odcfn.kernels.local import LocalWorld, run_local
from odcfn.kernels.nvshmem import nvshmem_transport
from odcfn.kernels.shm import ShmTransport

__all__ = [
    "CollectiveTransport",
    "Counters",
    "Done",
    "Handle",
    "LocalWorld",
    "ShmTransport",
    "TorchCollectives",
    "Transport",
    "TransportError",
    "cuda_ipc_transport",
    "nvshmem_transport",
    "run_local",
]
