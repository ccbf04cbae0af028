"""The fused head's argument checks (``odcfn.kernels.fused_head``): each bad argument gets a
``ValueError`` that names it, before any tile is computed."""

from __future__ import annotations

import torch

from odcfn._check import check_int, check_number

__all__ = ["IGNORE", "check_args", "check_chunk", "check_temperature"]

IGNORE = -100  # a label that is not a target (a prompt token, padding)


def check_temperature(temperature: object, name: str = "temperature") -> float:
    return check_number(temperature, name, positive=True, want="> 0 (a finite number)")


def check_chunk(chunk: object, name: str) -> int | None:
    return check_int(chunk, name, at_least=1, none_ok=True, want="an int >= 1 or None")


def _check_labels(labels_T: torch.Tensor, T: int, V: int) -> None:
    if not isinstance(labels_T, torch.Tensor) or labels_T.dtype != torch.int64 or labels_T.shape != (T,):
        is_t = isinstance(labels_T, torch.Tensor)
        got = f"{tuple(labels_T.shape)} {labels_T.dtype}" if is_t else type(labels_T).__name__
        raise ValueError(f"labels_T must be an int64 tensor of shape ({T},), got {got}")
    if T:
        lo, hi = int(labels_T.min()), int(labels_T.max())
        bad = (lo < 0 and (lo != IGNORE or int(labels_T[labels_T < 0].max()) != IGNORE)) or hi >= V
        if bad:
            raise ValueError(
                f"labels_T must lie in [0, vocab_size={V}) or equal {IGNORE} (not a target); "
                f"got values in [{lo}, {hi}]"
            )


def check_args(h_TxD: torch.Tensor, w_VxD: torch.Tensor, labels_T: torch.Tensor, temperature: object,
               token_chunk: object, vocab_chunk: object) -> float:
    """``fused_head``'s arguments checked (a ``ValueError`` naming the culprit); the temperature."""
    for name, x in (("h_TxD", h_TxD), ("w_VxD", w_VxD)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
            raise ValueError(f"{name} must be a 2-D floating tensor, got {getattr(x, 'shape', type(x))}")
    if h_TxD.shape[1] != w_VxD.shape[1] or h_TxD.dtype != w_VxD.dtype:
        raise ValueError(
            f"h_TxD {tuple(h_TxD.shape)} {h_TxD.dtype} and w_VxD {tuple(w_VxD.shape)} {w_VxD.dtype} "
            "must share the hidden size and dtype"
        )
    check_chunk(token_chunk, "token_chunk")
    check_chunk(vocab_chunk, "vocab_chunk")
    _check_labels(labels_T, h_TxD.shape[0], w_VxD.shape[0])
    return check_temperature(temperature)
