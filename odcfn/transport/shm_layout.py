"""Where every byte of a ``ShmTransport`` rank's /dev/shm segment lives (``odcfn.transport.shm``
gives the protocol; ``odcfn.transport.shm_hpz`` the hierarchical shards)::

    ctrl      int64[16 + W]       version | pid | abort | beat | arrive | ... | done[client]
    counters  int64[2^16, 2]      (step, value) per ``fetch_add`` counter (only rank 0's is used)
    pub       per unit: this rank's parameter shard in the compute dtype (what gathers read)
    acc       per unit: this rank's fp32 gradient accumulator (what scatter-accumulates add into)
    stamps    int64[U, 2]         hpZ: (group size k, step) of this rank's secondary slice of unit u
    sec       per unit: this rank's hpZ slice, compute dtype, room for the whole padded unit (k = 1)

The ``counters`` and ``sec`` regions are sparse in the file: pages nobody writes cost no memory,
so a run without hierarchical shards pays nothing for ``sec`` and a run with ``k`` pays 1/k of
each resharded unit (``shm_hpz`` releases those pages again after the step's sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from odcfn.kernels.quant import Format
from odcfn.sharding import Layout
from odcfn.transport.base import MAX_COUNTERS

__all__ = ["ABORT", "ARRIVE", "BEAT", "DONE", "PID", "VERSION", "SegLayout", "describe", "dtype_code"]

VERSION, PID, ABORT, BEAT, ARRIVE, DONE = 0, 1, 2, 3, 4, 16  # ctrl words
_ALIGN = 64
_PAGE = 4096  # the hpZ slices start and end on a page: released whole after the sync

# dtype codes for the agreement check at mapping time
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FORMATS = ("bf16", "fp8_e4m3", "int8", "fp32")


def describe(code: int) -> str:
    """``dtype_code``'s code of a dtype and gather format, in words."""
    dt, f, block = code % 8, (code // 8) % 8, code // 64
    said = str(_DTYPES[dt]) if dt < len(_DTYPES) else "another dtype"
    return said if not f else f"{said}, gather_format={_FORMATS[f - 1]!r} (block {block})"


def dtype_code(dtype: torch.dtype, fmt: Format | None) -> int:
    """The dtype and gather format as one small integer (both decide the published bytes)."""
    code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    if fmt is not None:
        code += 8 * (1 + _FORMATS.index(fmt.name)) + 64 * fmt.block
    return code


def _align(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class SegLayout:
    """Byte offsets inside every rank's segment (identical on all ranks)."""

    key: tuple
    nbytes: int
    counters: int
    pub: dict[str, int]
    acc: dict[str, int]
    sizes: dict[str, int]
    stamps: int = 0  # int64[U, 2]: (k, step) per unit, in ``layout.units`` order
    sec: dict[str, int] | None = None  # per unit: its hpZ slice
    sec_span: tuple[int, int] = (0, 0)  # (start, end) bytes of all slices: whole pages

    @classmethod
    def build(cls, layout: Layout, dtype: torch.dtype, world: int, fmt: Format | None = None) -> SegLayout:
        key = (tuple((u.name, u.shard_size, u.frozen) for u in layout.units), dtype, world, fmt)
        esize = torch.empty((), dtype=dtype).element_size()
        counters = _align((DONE + world) * 8)
        off = _align(counters + MAX_COUNTERS * 2 * 8)
        pub, acc, sizes, sec = {}, {}, {}, {}
        for u in layout.units:  # a quantized publication: the format's bytes, scales included
            nbytes = u.shard_size * esize if fmt is None else fmt.nbytes(u.shard_size)
            pub[u.name], off = off, _align(off + nbytes)
            sizes[u.name] = u.shard_size
        for u in layout.units:
            if not u.frozen:  # a frozen unit is never scattered into: no accumulator
                acc[u.name], off = off, _align(off + u.shard_size * 4)
        stamps, off = off, _align(off + len(layout.units) * 2 * 8, _PAGE)
        lo = off
        for u in layout.units:  # the gathered copy's dtype (gather formats unpublish into it)
            sec[u.name], off = off, _align(off + u.padded_numel * esize)
        off = _align(off, _PAGE)
        return cls(key, off, counters, pub, acc, sizes, stamps, sec, (lo, off))
