"""The fused linear head as Triton kernels: per-token log-probs, entropies and their gradients
without a T×V tensor (the GPU path of ``odcfn.kernels.fused_head``; same contract).

For hidden states ``h`` (T×D), head weight ``W`` (V×D), temperature ``τ``, logits
``z = h Wᵀ / τ``: ``logp_t = z_{t,y_t} − lse_t`` and ``H_t = lse_t − Σ_v p_{t,v} z_{t,v}``.

Forward (``_head_fwd_kernel``): a program owns ``BLOCK_T`` tokens and one of ``splits`` slices
of the vocabulary; it walks its slice in ``BLOCK_V`` tiles, each tile's logits a ``tl.dot``
over ``BLOCK_D`` pieces of D, keeping per token a running max ``m``, ``s = Σ e^{z−m}``,
``u = Σ e^{z−m}(z−m)`` and the target's logit. The slices' partial sums are combined in torch
(O(T × splits)). Splitting the vocabulary lets a short sequence (T=2K: 32 token blocks) still
fill every SM; one slice per program would leave most of an H200 idle.

Backward: two kernels, no atomics, bit-identical run to run. Both recompute a tile's logits
from h, W and the saved lse (``_tile_dz``) and form ``dz = g_logp·(onehot − p) − g_H·p·(log p +
H)`` (``1/τ`` folded into the upstream gradients). ``_head_bwd_dw_kernel``: a program OWNS one
vocabulary tile of dW (BLOCK_V rows × all of D) and walks every token block in order, adding
``dzᵀ h`` by plain load/add/store into rows no other program touches. ``_head_bwd_dh_kernel``:
a program owns a token block of dh (per vocabulary slice: short sequences still fill the GPU,
the ≤ 4 slice partials are summed in slice order) and walks its slice's tiles in order. The
price: the logits are recomputed twice (8·T·V·D backward FLOPs instead of 6), against ~T·V·D/
BLOCK_T fp32 atomics (10¹¹ at 32K × 151,936 × 3,584) and a run-to-run varying sum order in the
atomic design this replaces; docs/gpu.md estimates both on an H200.

Labels equal to -100 are not targets: their rows are dropped before the kernels (logp, entropy
and lse 0, no gradient). fp32 inputs use full-precision dots (``ieee``, as torch's fp32 GEMMs
when TF32 is off); bf16/fp16 inputs use tensor-core dots with fp32 accumulation, ``dz`` cast to
the input dtype for the two gradient dots (what autograd's unfused bf16 backward does).

Importing this module needs ``triton``. The launchers take CUDA tensors, or CPU tensors when
``TRITON_INTERPRET=1`` was set before triton was imported (how the CPU tests run them).
Not yet run on GPU hardware: compiled for sm_90 in the tests, correct under the interpreter.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

__all__ = ["interpreting", "triton_head_backward", "triton_head_forward"]

IGNORE = -100
# the running max before any logit: finite, so exp(m_old - m_new) * s is 0, not NaN
_NEG = tl.constexpr(-1.0e30)
# tiles for the compiled kernels, by (kernel, 16-bit inputs?). 16-bit: a 64 x 128 fp32 logit tile
# on tensor cores (the backward holds dz beside it, so thinner D pieces and 8 warps); fp32 dots
# run on FMA units and hold their operands in registers: smaller tiles. Chosen so ptxas spills
# little on sm_90 (tests/kernels/test_fused_head_triton.py reports it); not tuned on hardware yet.
GPU_BLOCKS = {
    ("fwd", True): {"block_t": 64, "block_v": 128, "block_d": 64, "num_warps": 4},
    ("bwd", True): {"block_t": 64, "block_v": 128, "block_d": 32, "num_warps": 8},
    ("fwd", False): {"block_t": 32, "block_v": 64, "block_d": 32, "num_warps": 4},
    ("bwd", False): {"block_t": 32, "block_v": 64, "block_d": 16, "num_warps": 4},
}
# the interpreter runs a program in ~1-2 ms whatever its size: the smallest tl.dot tiles
INTERPRETER_BLOCKS = {"block_t": 16, "block_v": 16, "block_d": 16, "num_warps": 1}
_INTERPRETER_LOCK = threading.Lock()  # the interpreter patches module state while it runs


# The kernels call triton builtins only (not tl.sum/tl.max/tl.zeros: those are jit functions
# of triton's own library, interpreted only if triton was imported while TRITON_INTERPRET=1,
# which a test session that also compiles kernels cannot promise). The reductions name the
# library's own combine functions, which the interpreter runs as numpy sums/maxima.
_sum_combine = tl.standard._sum_combine
_max_combine = tl.standard._elementwise_max


@triton.jit
def _rowsum(x):
    return tl.reduce(x, 1, _sum_combine)


@triton.jit
def _rowmax(x):
    return tl.reduce(x, 1, _max_combine)


@triton.jit
def _head_fwd_kernel(
    h_ptr, w_ptr, y_ptr, m_ptr, s_ptr, u_ptr, tgt_ptr,
    T, V, D, v_per_split, inv_tau,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    WANT_ENTROPY: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Partial (m, s, u, target logit) of BLOCK_T tokens over one vocabulary slice."""
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    h_row = h_ptr + rows.to(tl.int64)[:, None] * D
    m = tl.full((BLOCK_T,), _NEG, tl.float32)
    s = tl.full((BLOCK_T,), 0.0, tl.float32)
    u = tl.full((BLOCK_T,), 0.0, tl.float32)
    tgt = tl.full((BLOCK_T,), 0.0, tl.float32)
    v_lo = split * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        w_row = w_ptr + cols.to(tl.int64)[:, None] * D
        acc = tl.full((BLOCK_T, BLOCK_V), 0.0, tl.float32)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            d_ok = ds < D
            h = tl.load(h_row + ds[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            w = tl.load(w_row + ds[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
        z = acc * inv_tau
        tgt += _rowsum(tl.where(cols[None, :] == y[:, None], z, 0.0))
        z = tl.where(col_ok[None, :], z, -float("inf"))
        m_new = tl.maximum(m, _rowmax(z))
        zc = z - m_new[:, None]  # <= 0; -inf on padding columns
        e = tl.exp(zc)
        a = tl.exp(m - m_new)  # old sums re-expressed against the new max
        if WANT_ENTROPY:
            u = a * (u + (m - m_new) * s) + _rowsum(e * tl.where(col_ok[None, :], zc, 0.0))
        s = a * s + _rowsum(e)
        m = m_new
    out = split * T + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(tgt_ptr + out, tgt, mask=row_ok)
    if WANT_ENTROPY:
        tl.store(u_ptr + out, u, mask=row_ok)


@triton.jit
def _tile_dz(
    h_ptr, w_ptr, y_ptr, lse_ptr, ent_ptr, gl_ptr, gh_ptr, rows, cols, T, V, D, inv_tau,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    WITH_ENTROPY: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """The logits' gradient ``dz`` of one BLOCK_T × BLOCK_V tile, recomputed from h, W and the
    saved lse (0 outside the tile's valid rows/columns), in the dtype of the gradient dots."""
    row_ok = rows < T
    col_ok = cols < V
    h_row = h_ptr + rows.to(tl.int64)[:, None] * D
    w_row = w_ptr + cols.to(tl.int64)[:, None] * D
    acc = tl.full((BLOCK_T, BLOCK_V), 0.0, tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        d_ok = ds < D
        h = tl.load(h_row + ds[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_row + ds[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    gl = tl.load(gl_ptr + rows, mask=row_ok, other=0.0)
    logp = acc * inv_tau - lse[:, None]
    p = tl.exp(logp)
    if WITH_ENTROPY:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        gh = tl.load(gh_ptr + rows, mask=row_ok, other=0.0)
        dz = -p * (gl[:, None] + gh[:, None] * (logp + ent[:, None]))
    else:
        dz = -p * gl[:, None]
    dz += tl.where(cols[None, :] == y[:, None], gl[:, None], 0.0)
    dz = tl.where(row_ok[:, None] & col_ok[None, :], dz, 0.0)
    dz_c = dz.to(h_ptr.dtype.element_ty)  # as autograd's bf16 backward rounds the logits' grad
    if UPCAST:
        dz_c = dz_c.to(tl.float32)
    return dz_c


@triton.jit
def _head_bwd_dh_kernel(
    h_ptr, w_ptr, y_ptr, lse_ptr, ent_ptr, gl_ptr, gh_ptr, dh_ptr,
    T, V, D, v_per_split, inv_tau,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    WITH_ENTROPY: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Program (t, k) owns rows ``t`` of the fp32 partial ``dh[k]`` (k: vocabulary slice) and
    walks its slice's tiles IN ORDER, adding ``dz W`` by plain load/add/store: no other program
    writes those bytes, so no atomics and the same order every run."""
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    dh_rows = dh_ptr + pid_k.to(tl.int64) * T * D + rows.to(tl.int64)[:, None] * D
    for v0 in range(0, v_per_split, BLOCK_V):
        cols = pid_k * v_per_split + v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        dz_c = _tile_dz(h_ptr, w_ptr, y_ptr, lse_ptr, ent_ptr, gl_ptr, gh_ptr, rows, cols, T, V, D, inv_tau,
                        BLOCK_T, BLOCK_V, BLOCK_D, WITH_ENTROPY, PRECISION, UPCAST)  # fmt: skip
        w_row = w_ptr + cols.to(tl.int64)[:, None] * D
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            d_ok = ds < D
            w = tl.load(w_row + ds[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            # one pointer tensor for the load and the store: each element is read and written
            # by the same thread, iteration after iteration (program order, no race)
            ptrs = dh_rows + ds[None, :]
            m = row_ok[:, None] & d_ok[None, :]
            dh = tl.dot(dz_c, w, input_precision=PRECISION)  # BLOCK_T × BLOCK_D
            tl.store(ptrs, tl.load(ptrs, mask=m, other=0.0) + dh, mask=m)


@triton.jit
def _head_bwd_dw_kernel(
    h_ptr, w_ptr, y_ptr, lse_ptr, ent_ptr, gl_ptr, gh_ptr, dw_ptr,
    T, V, D, inv_tau,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    WITH_ENTROPY: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Program v owns rows ``v`` of dW (one vocabulary tile, all of D) and walks every token
    block IN ORDER, recomputing the tile's dz from the saved lse and adding ``dzᵀ h``: each dW
    element has one writer, so no atomics and a bit-identical result run to run."""
    pid_v = tl.program_id(0)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    dw_rows = dw_ptr + cols.to(tl.int64)[:, None] * D
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        dz_c = _tile_dz(h_ptr, w_ptr, y_ptr, lse_ptr, ent_ptr, gl_ptr, gh_ptr, rows, cols, T, V, D, inv_tau,
                        BLOCK_T, BLOCK_V, BLOCK_D, WITH_ENTROPY, PRECISION, UPCAST)  # fmt: skip
        h_row = h_ptr + rows.to(tl.int64)[:, None] * D
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            d_ok = ds < D
            h = tl.load(h_row + ds[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                h = h.to(tl.float32)
            ptrs = dw_rows + ds[None, :]
            m = col_ok[:, None] & d_ok[None, :]
            dw = tl.dot(tl.trans(dz_c), h, input_precision=PRECISION)  # BLOCK_V × BLOCK_D
            tl.store(ptrs, tl.load(ptrs, mask=m, other=0.0) + dw, mask=m)


# --- launchers ---------------------------------------------------------------------------------


def interpreting() -> bool:
    """True when the kernels run on the CPU through triton's interpreter."""
    return type(_head_fwd_kernel).__name__ == "InterpretedFunction"


def _blocks(kind: str, dtype: torch.dtype, overrides: dict) -> dict:
    b = dict(INTERPRETER_BLOCKS if interpreting() else GPU_BLOCKS[kind, dtype != torch.float32])
    return b | {k: v for k, v in overrides.items() if v is not None}


def _launch(kernel, grid, args: tuple, meta: dict) -> None:
    if interpreting():
        meta = {k: v for k, v in meta.items() if k != "num_warps"}
        with _INTERPRETER_LOCK:
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def _dot_meta(dtype: torch.dtype) -> dict:
    """fp32: exact fp32 products (TF32 would cost ~3 decimal digits); 16-bit: tensor cores.
    The interpreter's ``tl.dot`` mistakes bf16 (stored as uint16) for integers, so there 16-bit
    tiles are widened first: a bf16 x bf16 product is exact in fp32, so the result is the
    tensor-core dot's up to the order of the fp32 sums."""
    up = interpreting() and dtype != torch.float32
    return {"PRECISION": "ieee" if dtype == torch.float32 or up else None, "UPCAST": up}


def _rows(labels_T: torch.Tensor) -> torch.Tensor | None:
    keep_T = labels_T != IGNORE
    return None if bool(keep_T.all()) else keep_T.nonzero().squeeze(1)


def _splits(n_tblocks: int, n_vblocks: int, device: torch.device) -> int:
    """Vocabulary slices per token block: about four programs per SM in all."""
    if device.type != "cuda":
        return min(n_vblocks, 3)  # the interpreter: a few slices, so the combine is exercised
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_vblocks, triton.cdiv(4 * sms, n_tblocks)))


@torch.no_grad()
def triton_head_forward(
    h_TxD: torch.Tensor,
    w_VxD: torch.Tensor,
    labels_T: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    *,
    splits: int | None = None,
    block_t: int | None = None,
    block_v: int | None = None,
    block_d: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(logp_T, entropy_T or None, lse_T)`` fp32, 0 where the label is -100: as
    ``fused_head.head_forward``. ``splits``/``block_*``: tuning (None: from the shapes)."""
    T, D = h_TxD.shape
    V = w_VxD.shape[0]
    dev = h_TxD.device
    logp_T = torch.zeros(T, dtype=torch.float32, device=dev)
    ent_T = torch.zeros_like(logp_T) if want_entropy else None
    lse_T = torch.zeros_like(logp_T)
    rows = _rows(labels_T)
    h, y = (h_TxD, labels_T) if rows is None else (h_TxD[rows], labels_T[rows])
    n = h.shape[0]
    if n == 0:
        return logp_T, ent_T, lse_T
    h, w, y = h.contiguous(), w_VxD.contiguous(), y.contiguous()
    b = _blocks("fwd", h.dtype, {"block_t": block_t, "block_v": block_v, "block_d": block_d})
    n_t, n_v = triton.cdiv(n, b["block_t"]), triton.cdiv(V, b["block_v"])
    k = max(1, min(splits or _splits(n_t, n_v, dev), n_v))
    v_per_split = triton.cdiv(n_v, k) * b["block_v"]  # whole tiles per slice; none is empty
    k = triton.cdiv(V, v_per_split)
    m, s, u, tgt = (torch.empty(k, n, dtype=torch.float32, device=dev) for _ in range(4))
    meta = {"BLOCK_T": b["block_t"], "BLOCK_V": b["block_v"], "BLOCK_D": b["block_d"],
            "WANT_ENTROPY": bool(want_entropy), **_dot_meta(h.dtype), "num_warps": b["num_warps"]}
    args = (h, w, y, m, s, u, tgt, n, V, D, v_per_split, 1.0 / temperature)
    _launch(_head_fwd_kernel, (n_t, k), args, meta)
    # combine the slices: sums re-expressed against the overall max
    M = m.amax(0)
    a = (m - M).exp()
    S = (a * s).sum(0)
    log_S = S.log()
    idx = slice(None) if rows is None else rows
    lse_T[idx] = M + log_S
    logp_T[idx] = tgt.sum(0) - (M + log_S)
    if want_entropy:
        U = (a * (u + (m - M) * s)).sum(0)
        ent_T[idx] = log_S - U / S
    return logp_T, ent_T, lse_T


@torch.no_grad()
def triton_head_backward(
    h_TxD: torch.Tensor,
    w_VxD: torch.Tensor,
    labels_T: torch.Tensor,
    lse_T: torch.Tensor,
    entropy_T: torch.Tensor | None,
    g_logp_T: torch.Tensor,
    g_entropy_T: torch.Tensor | None,
    temperature: float,
    *,
    block_t: int | None = None,
    block_v: int | None = None,
    block_d: int | None = None,
    splits: int | None = None,
    dw_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh_TxD in h's dtype, dw_VxD fp32)``, the gradients of ``Σ g_logp·logp + Σ g_H·H``: as
    ``fused_head.head_backward``. ``entropy_T``/``g_entropy_T`` may be None (no entropy term).
    ``dw_out`` (fp32, contiguous V×D): dW is ADDED into it (the dW kernel loads, adds and stores
    its own rows) and it is returned, so no V×D buffer of its own is allocated."""
    T, D = h_TxD.shape
    V = w_VxD.shape[0]
    dev = h_TxD.device
    if dw_out is not None and (dw_out.shape != (V, D) or dw_out.dtype != torch.float32
                               or not dw_out.is_contiguous()):
        raise ValueError(f"dw_out must be a contiguous fp32 ({V}, {D}) tensor, got "
                         f"{tuple(dw_out.shape)} {dw_out.dtype}")
    dw_VxD = torch.zeros(V, D, dtype=torch.float32, device=dev) if dw_out is None else dw_out
    dh_TxD = torch.zeros_like(h_TxD)
    rows = _rows(labels_T)
    pick = (lambda x: x) if rows is None else (lambda x: x[rows])
    h = pick(h_TxD).contiguous()
    n = h.shape[0]
    if n == 0:
        return dh_TxD, dw_VxD
    with_h = entropy_T is not None and g_entropy_T is not None
    inv_tau = 1.0 / temperature
    gl = (pick(g_logp_T).float() * inv_tau).contiguous()  # dz is linear in them: fold 1/τ in
    if with_h:
        gh = (pick(g_entropy_T).float() * inv_tau).contiguous()
        ent = pick(entropy_T).float().contiguous()
    else:
        gh = ent = gl  # never read (WITH_ENTROPY is False)
    y, lse = pick(labels_T).contiguous(), pick(lse_T).float().contiguous()
    b = _blocks("bwd", h.dtype, {"block_t": block_t, "block_v": block_v, "block_d": block_d})
    n_t, n_v = triton.cdiv(n, b["block_t"]), triton.cdiv(V, b["block_v"])
    # dh: vocabulary slices give a short sequence enough programs; each slice has its own fp32
    # partial (k × n × D), summed below in slice order: deterministic. Capped at 4 slices.
    k = max(1, min(splits or min(_splits(n_t, n_v, dev), 4), n_v))
    v_per_split = triton.cdiv(n_v, k) * b["block_v"]
    k = triton.cdiv(V, v_per_split)
    dh_parts = torch.zeros(k, n, D, dtype=torch.float32, device=dev)
    meta = {"BLOCK_T": b["block_t"], "BLOCK_V": b["block_v"], "BLOCK_D": b["block_d"],
            "WITH_ENTROPY": with_h, **_dot_meta(h.dtype), "num_warps": b["num_warps"]}
    w = w_VxD.contiguous()
    common = (h, w, y, lse, ent, gl, gh)
    _launch(_head_bwd_dh_kernel, (n_t, k), (*common, dh_parts, n, V, D, v_per_split, inv_tau), meta)
    _launch(_head_bwd_dw_kernel, (n_v,), (*common, dw_VxD, n, V, D, inv_tau), meta)
    dh = (dh_parts[0] if k == 1 else dh_parts.sum(0)).to(h_TxD.dtype)
    if rows is None:
        return dh, dw_VxD
    dh_TxD[rows] = dh
    return dh_TxD, dw_VxD
