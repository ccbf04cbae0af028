"""The GPU transports: CUDA IPC within a node (``cuda_ipc.py``) and NVSHMEM across nodes
(``nvshmem.py``), over one engine (``_engine.py``), wire protocol (``_protocol.py``) and device map
(``_devices.py``); the NVSHMEM device kernels (``_nvshmem_device.py``) and the ahead-of-time
compiler of every GPU kernel (``_compile.py``). Re-exports only."""

from odcfn.transport.gpu.cuda_ipc import cuda_ipc_transport
from odcfn.transport.gpu.nvshmem import nvshmem_transport

__all__ = ["cuda_ipc_transport", "nvshmem_transport"]
