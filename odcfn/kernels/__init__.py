from odcfn.kernels.base import Counters, Done, Handle, Transport, TransportError
from odcfn.kernels.local import LocalWorld, run_local

__all__ = ["Counters", "Done", "Handle", "LocalWorld", "Transport", "TransportError", "run_local"]
