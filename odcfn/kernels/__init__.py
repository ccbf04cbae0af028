from odcfn.kernels.base import Counters, Done, Handle, Transport, TransportError
from odcfn.kernels.collective import CollectiveTransport
from odcfn.kernels.local import LocalWorld, run_local
from odcfn.kernels.shm import ShmTransport

__all__ = [
    "CollectiveTransport",
    "Counters",
    "Done",
    "Handle",
    "LocalWorld",
    "ShmTransport",
    "Transport",
    "TransportError",
    "run_local",
]
