"""Compute kernels, no communication: the Triton ops the GPU transports launch
(``triton_ops.py``), the fused linear head and its checks (``fused_head.py``,
``fused_head_triton.py``, ``head_checks.py``), the embedding (``embedding.py``) and the gradient
sink (``grad_sink.py``). Import the modules themselves (Triton is an optional dependency)."""
