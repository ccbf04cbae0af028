"""The head settings every loss (and ``odcfn.losses.LogProbs``) carries, checked at construction:
shared by ``odcfn.losses`` and ``odcfn.losses.preference`` without an import circle."""

from __future__ import annotations

from odcfn.kernels.fused_head import check_chunk, check_temperature

__all__ = ["HEADS", "check_head"]

HEADS = ("fused", "unfused")


def check_head(obj: object) -> None:
    """A ValueError naming a bad ``temperature``, ``head``, ``token_chunk`` or ``vocab_chunk``."""
    check_temperature(obj.temperature)
    if obj.head not in HEADS:
        raise ValueError(f"head must be one of {list(HEADS)}, got {obj.head!r}")
    check_chunk(obj.token_chunk, "token_chunk")
    check_chunk(obj.vocab_chunk, "vocab_chunk")
