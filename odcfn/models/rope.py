"""Rotary position embeddings and the frequency scalings long-context checkpoints use.

``inv_freq(head_dim, theta, scaling)`` returns the per-pair inverse frequencies and the factor
cos/sin are multiplied by, with the meaning transformers gives ``rope_type`` "linear",
"llama3" and "yarn" (its ``modeling_rope_utils``), so a checkpoint trained with one of them
computes the same attention here. Every scaling is a fixed function of the config (none depends
on the sequence length), so the cost model and the packing stay what they are for plain RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["ROPE_KINDS", "RopeScaling", "apply_rope", "inv_freq", "rope_tables", "rotate"]

ROPE_KINDS = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """One of transformers' static RoPE scalings, its fields resolved (no defaults left to look up).

    ``kind`` "linear": every frequency divided by ``factor``. "llama3": long wavelengths divided
    by ``factor``, short ones kept, a smooth blend between ``original_max_position_embeddings /
    low_freq_factor`` and ``/ high_freq_factor``. "yarn": per-dimension blend of interpolated and
    extrapolated frequencies over the correction range set by ``beta_fast``/``beta_slow``, and
    cos/sin scaled by ``attention_factor`` (from ``factor``, ``mscale``, ``mscale_all_dim`` when
    not given)."""

    kind: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RopeScaling.kind={self.kind!r}; supported: {list(ROPE_KINDS)}")
        if not (isinstance(self.factor, (int, float)) and self.factor > 0):
            raise ValueError(f"RopeScaling.factor must be a positive number, got {self.factor!r}")
        if self.kind in ("llama3", "yarn") and not self.original_max_position_embeddings:
            raise ValueError(f"rope_type={self.kind!r} needs original_max_position_embeddings")
        if self.kind == "llama3":
            lo, hi = self.low_freq_factor, self.high_freq_factor
            if lo is None or hi is None:
                raise ValueError("rope_type='llama3' needs low_freq_factor and high_freq_factor")
            if not hi > lo:
                raise ValueError(f"rope_type='llama3' needs high_freq_factor ({hi}) > low_freq_factor ({lo})")

    def to_hf(self) -> dict:
        """The ``rope_parameters`` entries (without ``rope_theta``) transformers reads back."""
        out: dict = {"rope_type": self.kind, "factor": self.factor}
        if self.kind in ("llama3", "yarn"):
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.kind == "llama3":
            out |= {"low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor}
        if self.kind == "yarn":
            out |= {"beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "truncate": self.truncate}
            for k in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, k) is not None:
                    out[k] = getattr(self, k)
        return out

    def yarn_attention_factor(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def m(scale: float, k: float = 1.0) -> float:  # the paper's 0.1 ln(s) + 1 temperature
            return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return m(self.factor, self.mscale) / m(self.factor, self.mscale_all_dim)
        return m(self.factor)


def _yarn(base_K2: torch.Tensor, K: int, theta: float, s: RopeScaling) -> torch.Tensor:
    # the dimension whose wavelength fits `turns` times into the original context
    def dim_for(turns: float) -> float:
        ctx = s.original_max_position_embeddings
        return K * math.log(ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_for(s.beta_fast), dim_for(s.beta_slow)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, K - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(K // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies kept), 0: interpolate (divided by factor)
    return base_K2 / s.factor * (1 - keep) + base_K2 * keep


def _llama3(base_K2: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old = s.original_max_position_embeddings
    wavelen = 2 * math.pi / base_K2
    long_wl, short_wl = old / s.low_freq_factor, old / s.high_freq_factor
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * base_K2 / s.factor + smooth * base_K2
    out = torch.where(wavelen > long_wl, base_K2 / s.factor, blended)
    return torch.where(wavelen < short_wl, base_K2, out)


@lru_cache(maxsize=64)
def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """``(inv_freq of shape (head_dim // 2,), fp32 on CPU; cos/sin multiplier)``. Cached: callers
    must not modify the tensor."""
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return base, 1.0
    if scaling.kind == "linear":
        return base / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return _llama3(base, scaling), 1.0
    return _yarn(base, head_dim, theta, scaling), scaling.yarn_attention_factor()


def rope_tables(
    positions_T: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos_TxK, sin_TxK)`` for ``rotate``: angles and cos/sin in fp32, cast to ``dtype``.
    Separate from ``apply_rope`` so that a caller rotating many tensors at the same positions
    (every layer of a decode step) computes them once."""
    freq_K2, scale = inv_freq(head_dim, float(theta), scaling)
    ang_TxK = torch.outer(positions_T.float(), freq_K2.to(positions_T.device)).repeat(1, 2)
    cos, sin = ang_TxK.cos(), ang_TxK.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rotate(x_xK: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face's layout) with tables from ``rope_tables`` (broadcast)."""
    x1, x2 = x_xK.chunk(2, dim=-1)
    return x_xK * cos + torch.cat([-x2, x1], dim=-1) * sin


def apply_rope(
    x_HxTxK: torch.Tensor, positions_T: torch.Tensor, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face's layout), angles and cos/sin in fp32, cast to ``x``'s dtype."""
    cos, sin = rope_tables(positions_T.to(x_HxTxK.device), x_HxTxK.shape[-1], theta, scaling, x_HxTxK.dtype)
    return rotate(x_HxTxK, cos, sin)
