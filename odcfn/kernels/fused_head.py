"""A linear head that never holds T×V: per-token log-probs (and entropies) of the targets.

For hidden states ``h`` (after the final norm), head weight ``W`` (V×D; tied: the embedding
matrix), temperature ``τ`` and logits ``z = h Wᵀ / τ``:

    logp_t = z_{t,y_t} − lse_t          H_t = lse_t − Σ_v p_{t,v} z_{t,v}

The forward walks tiles of ``token_chunk`` tokens × ``vocab_chunk`` vocabulary entries keeping,
per token, a running max ``m``, ``s = Σ e^{z−m}`` and ``u = Σ e^{z−m}(z−m)`` (so
``H = log s − u/s``: two non-negative terms, no cancellation) plus the target's logit. It saves
only O(T) things (h, labels, lse, H). The backward recomputes each tile's logits:

    dz = g_logp·(onehot − p) − g_H·p·(log p + H);   dh += dz W / τ;   dW += dzᵀ h / τ

with dW summed per vocabulary slice in fp32 and added into ``dw_out`` (in the step: the unit's
flat gradient, ``grad_sink``; else one fp32 V×D buffer). Peak extra memory is a few
``token_chunk × vocab_chunk`` fp32 tiles. Math is fp32 whatever the compute dtype (bf16 GEMMs
produce bf16 logits that are widened, as the unfused ``F.linear(...).float()`` does).

Labels equal to ``IGNORE`` (-100) are not targets: their logp and entropy are 0 and they get no
gradient (their rows are skipped entirely, which is what makes RL prompts cost nothing here).

``head_forward`` / ``head_backward`` are the torch path (CPU, and the reference for the Triton
kernel in ``fused_head_triton``, which has the same two signatures and is used on CUDA when it
imports). ``fused_head`` is the differentiable op; ``unfused_head`` the full-logits reference
head (O(T×V): for comparison and for losses that ask for logits).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from odcfn.kernels.grad_sink import destination
from odcfn.kernels.head_checks import IGNORE, check_args, check_chunk, check_temperature

__all__ = [
    "IGNORE",
    "check_chunk",
    "check_temperature",
    "default_chunks",
    "fused_head",
    "head_backward",
    "head_forward",
    "unfused_head",
]

# fp32 elements of one logits tile (32 MiB; a few live at once): big enough that the tile GEMMs
# run at the full-matrix rate on the CPUs this was tuned on, small against any T×V
_TILE_ELEMS = 1 << 23
_VOCAB_CHUNK = 8192
# below this many logits (4 MiB fp32) fused_head runs the whole problem as one autograd tile
_SMALL = 1 << 20


def default_chunks(T: int, V: int) -> tuple[int, int]:
    """``(token_chunk, vocab_chunk)`` from the shapes: the whole vocabulary per tile when it is
    small (no running rescale), else ``_VOCAB_CHUNK``-entry slices; tiles of ``_TILE_ELEMS``."""
    vc = V if V <= 2 * _VOCAB_CHUNK else _VOCAB_CHUNK
    return max(1, min(T, _TILE_ELEMS // vc)), vc


def _rows(labels_T: torch.Tensor) -> torch.Tensor | None:
    """Indices of the target rows, or None when every row is a target."""
    keep_T = labels_T != IGNORE
    return None if bool(keep_T.all()) else keep_T.nonzero().squeeze(1)


class _Tiles:
    """Reused fp32 tile buffers: a fresh tile per (token, vocabulary) chunk costs the CPU a
    fresh mapping of pages (a 16K-token pass at V=151,936 faulted in ~90 GB that way); a tile
    from here is a contiguous view of one buffer allocated once per pass."""

    def __init__(self, tc: int, vc: int, like: torch.Tensor, n: int) -> None:
        self.bufs = [torch.empty(tc * vc, dtype=torch.float32, device=like.device) for _ in range(n)]

    def logits(self, hc: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
        """``hc @ wvᵀ`` widened to fp32 (the GEMM in hc's dtype, as ``F.linear(...).float()``)."""
        z = self.bufs[0][: hc.shape[0] * wv.shape[0]].view(hc.shape[0], wv.shape[0])
        if hc.dtype == torch.float32:
            return torch.matmul(hc, wv.t(), out=z)
        return z.copy_(F.linear(hc, wv))

    def exp(self, z: torch.Tensor) -> torch.Tensor:
        """``z.exp()`` into the second buffer (``z`` stays)."""
        return torch.exp(z, out=self.bufs[1][: z.numel()].view(z.shape))


def _chunks(T: int, V: int, token_chunk: int | None, vocab_chunk: int | None) -> tuple[int, int]:
    tc, vc = default_chunks(T, V)
    return token_chunk or tc, min(vocab_chunk or vc, V)


@torch.no_grad()
def head_forward(
    h_TxD: torch.Tensor,
    w_VxD: torch.Tensor,
    labels_T: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    *,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(logp_T, entropy_T or None, lse_T)``, fp32; 0 (lse: 0) where the label is IGNORE."""
    T, V = h_TxD.shape[0], w_VxD.shape[0]
    logp_T = torch.zeros(T, dtype=torch.float32, device=h_TxD.device)
    ent_T = torch.zeros_like(logp_T) if want_entropy else None
    lse_T = torch.zeros_like(logp_T)
    rows = _rows(labels_T)
    h, y = (h_TxD, labels_T) if rows is None else (h_TxD[rows], labels_T[rows])
    n = h.shape[0]
    tc, vc = _chunks(n, V, token_chunk, vocab_chunk)
    inv_tau = 1.0 / temperature
    lp_parts, ent_parts, lse_parts = [], [], []
    tiles = _Tiles(min(tc, n), vc, h, 2 if want_entropy else 1)
    for t0 in range(0, n, tc):
        hc, yc = h[t0 : t0 + tc], y[t0 : t0 + tc]
        m = s = u = None
        tgt = torch.empty(hc.shape[0], dtype=torch.float32, device=h.device)
        for v0 in range(0, V, vc):
            z = tiles.logits(hc, w_VxD[v0 : v0 + vc])
            if inv_tau != 1.0:
                z.mul_(inv_tau)
            inside = (yc >= v0) & (yc < v0 + z.shape[1])
            if bool(inside.any()):
                r = inside.nonzero().squeeze(1)
                tgt[r] = z[r, yc[r] - v0]
            mc = z.amax(1)
            m_new = mc if m is None else torch.maximum(m, mc)
            z.sub_(m_new[:, None])  # z - m <= 0
            if want_entropy:
                e = tiles.exp(z)
                sc = e.sum(1)
                uc = e.mul_(z).sum(1)  # Σ e·(z-m), in the tile (vecdot would allocate one)
                del e
            else:  # in place: one tile fewer to allocate and fault in
                sc, uc = z.exp_().sum(1), None
            del z
            if m is None:
                s, u = sc, uc
            else:
                d = m - m_new  # <= 0: the old sums re-expressed against the new max
                a = d.exp()
                if want_entropy:  # sum e^(z-m')(z-m') = a * (u + d * s) over the old entries
                    u = a * (u + d * s) + uc
                s = s * a + sc
            m = m_new
        log_s = s.log()
        lse_parts.append(m + log_s)
        lp_parts.append((tgt - m) - log_s)
        if want_entropy:
            ent_parts.append(log_s - u / s)
    if n:
        idx = slice(None) if rows is None else rows
        logp_T[idx] = torch.cat(lp_parts)
        lse_T[idx] = torch.cat(lse_parts)
        if want_entropy:
            ent_T[idx] = torch.cat(ent_parts)
    return logp_T, ent_T, lse_T


@torch.no_grad()
def head_backward(
    h_TxD: torch.Tensor,
    w_VxD: torch.Tensor,
    labels_T: torch.Tensor,
    lse_T: torch.Tensor,
    entropy_T: torch.Tensor | None,
    g_logp_T: torch.Tensor,
    g_entropy_T: torch.Tensor | None,
    temperature: float,
    *,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
    dw_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh_TxD in h's dtype, dw_VxD)``: the gradients of ``Σ g_logp·logp + Σ g_H·H``.
    ``entropy_T``/``g_entropy_T`` may be None (no entropy term). dW is fp32, or with ``dw_out``
    (V×D, any float dtype) ADDED into ``dw_out`` and returned as it: vocabulary slice by slice,
    each slice summed over the tokens in fp32 and added once, so no V×D fp32 buffer exists."""
    V = w_VxD.shape[0]
    dh_TxD = torch.zeros_like(h_TxD)
    if dw_out is None:
        dw_out = torch.zeros(w_VxD.shape, dtype=torch.float32, device=w_VxD.device)
    elif dw_out.shape != w_VxD.shape:
        raise ValueError(f"dw_out must have W's shape {tuple(w_VxD.shape)}, got {tuple(dw_out.shape)}")
    with_h = entropy_T is not None and g_entropy_T is not None
    rows = _rows(labels_T)
    pick = (lambda x: x) if rows is None else (lambda x: x[rows])
    h, y, lse = pick(h_TxD), pick(labels_T), pick(lse_T)
    inv_tau = 1.0 / temperature
    # dz is linear in the upstream gradients: fold the 1/τ of dh and dW into them
    gl = pick(g_logp_T).float() * inv_tau
    gH, H = (pick(g_entropy_T).float() * inv_tau, pick(entropy_T)) if with_h else (None, None)
    n = h.shape[0]
    if n == 0:
        return dh_TxD, dw_out
    tc, vc = _chunks(n, V, token_chunk, vocab_chunk)
    fp32 = w_VxD.dtype == torch.float32
    h32 = h if fp32 else h.float()  # dW's GEMM in fp32 (T×D: small against V×D)
    dh = torch.zeros(n, h.shape[1], dtype=torch.float32, device=h.device)
    tiles = _Tiles(min(tc, n), vc, h, 2 if with_h else 1)
    # fp32 rows straight into dw_out; else one vc×D fp32 slice, cast-added once it is complete
    direct = dw_out.dtype == torch.float32
    slice32 = None if direct else torch.empty(min(vc, V), h.shape[1], dtype=torch.float32, device=h.device)
    # vocabulary outside, tokens inside: a slice of dW is finished before the next one starts
    for v0 in range(0, V, vc):
        wv = w_VxD[v0 : v0 + vc]
        dw_v = dw_out[v0 : v0 + vc] if direct else slice32[: wv.shape[0]].zero_()
        for t0 in range(0, n, tc):
            t1 = min(n, t0 + tc)
            hc, yc, glc = h[t0:t1], y[t0:t1], gl[t0:t1]
            z = tiles.logits(hc, wv)
            if inv_tau != 1.0:
                z.mul_(inv_tau)
            z.sub_(lse[t0:t1, None])  # log p
            if with_h:  # dz = -p * (gl + gH * (log p + H)) + gl * onehot
                p = tiles.exp(z)
                coef = z.add_(H[t0:t1, None]).mul_(gH[t0:t1, None]).add_(glc[:, None])
                dz = p.mul_(coef).neg_()
            else:  # in place: p overwrites log p
                dz = z.exp_().mul_(glc[:, None].neg())
            del z
            inside = (yc >= v0) & (yc < v0 + wv.shape[0])
            if bool(inside.any()):
                r = inside.nonzero().squeeze(1)
                dz[r, yc[r] - v0] += glc[r]
            if fp32:
                dh[t0:t1].addmm_(dz, wv)
            else:  # bf16 GEMM for dh (as autograd's unfused backward), fp32 for dW's accumulation
                dh[t0:t1].add_(dz.to(wv.dtype) @ wv)
            dw_v.addmm_(dz.T, h32[t0:t1])
        if not direct:
            dw_out[v0 : v0 + vc].add_(dw_v)  # rounds once per slice, as a cast of the fp32 sum
    if rows is None:
        dh_TxD = dh.to(h_TxD.dtype)
    else:
        dh_TxD[rows] = dh.to(h_TxD.dtype)
    return dh_TxD, dw_out


@functools.cache
def _triton():
    """The Triton kernel's two functions, or None where it cannot serve (no module, no triton);
    asked only for CUDA tensors, once."""
    try:
        from odcfn.kernels import fused_head_triton as k
    except Exception:  # not built here (CPU), or triton missing: the torch path serves
        return None
    return k


class _FusedHead(torch.autograd.Function):
    """``(logp_T, entropy_T (empty without entropy), lse_T)``; lse is not differentiable. Written
    with ``setup_context`` so that ``torch.func`` transforms (the reference's ``grad``) work."""

    @staticmethod
    def forward(h_TxD, w_VxD, labels_T, temperature, want_entropy, token_chunk, vocab_chunk):
        kern = _triton() if h_TxD.is_cuda else None
        if kern is not None:
            logp, ent, lse = kern.triton_head_forward(h_TxD, w_VxD, labels_T, temperature, want_entropy)
        else:
            logp, ent, lse = head_forward(
                h_TxD,
                w_VxD,
                labels_T,
                temperature,
                want_entropy,
                token_chunk=token_chunk,
                vocab_chunk=vocab_chunk,
            )
        return logp, ent if want_entropy else logp.new_zeros(0), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        h_TxD, w_VxD, labels_T, temperature, want_entropy, token_chunk, vocab_chunk = inputs
        _, ent, lse = output
        ctx.save_for_backward(h_TxD, w_VxD, labels_T, lse, ent if want_entropy else None)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # an unused entropy costs nothing in backward
        ctx.args = (temperature, token_chunk, vocab_chunk)

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_lse):
        h, w, labels, lse, ent = ctx.saved_tensors
        temperature, tc, vc = ctx.args
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        if ent is None:
            g_ent = None
        # W a view of a unit's flat buffer (the step): dW lands in the flat gradient itself
        dest = destination(w) if ctx.needs_input_grad[1] else None
        kern = _triton() if h.is_cuda else None
        if kern is not None:
            fp32_out = dest is not None and dest.dtype == torch.float32 and dest.is_contiguous()
            dh, dw = kern.triton_head_backward(
                h, w, labels, lse, ent, g_logp, g_ent, temperature, dw_out=dest if fp32_out else None
            )
            if dest is not None and not fp32_out:  # a bf16 sink: one fp32 V×D transient on GPU
                dest.add_(dw)
        else:
            dh, dw = head_backward(
                h,
                w,
                labels,
                lse,
                ent,
                g_logp,
                g_ent,
                temperature,
                token_chunk=tc,
                vocab_chunk=vc,
                dw_out=dest,
            )
        dh = dh if ctx.needs_input_grad[0] else None
        # written into the sink: no gradient to return (the flat gradient already holds it)
        dw = dw.to(w.dtype) if ctx.needs_input_grad[1] and dest is None else None
        return dh, dw, None, None, None, None, None


def fused_head(
    h_TxD: torch.Tensor,
    w_VxD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``logp_T`` (and ``entropy_T`` with ``entropy=True``), fp32, of the targets
    ``labels_T`` (IGNORE: not a target, 0) under logits ``h Wᵀ / temperature``, never holding T×V.
    Chunks: None chooses from the shapes (``default_chunks``); a problem of at most ``_SMALL``
    logits with no chunk given runs as one plain-autograd tile."""
    t = check_args(h_TxD, w_VxD, labels_T, temperature, token_chunk, vocab_chunk)
    small = h_TxD.shape[0] * w_VxD.shape[0] <= _SMALL and token_chunk is None and vocab_chunk is None
    if small and not (h_TxD.is_cuda and _triton() is not None):
        # the whole problem is smaller than one tile: plain autograd over it is the same tile
        # math in a third of the operations (what tiny models and short samples pay per call)
        logp, ent, _ = unfused_head(h_TxD, w_VxD, labels_T, temperature=t, entropy=entropy)
        return (logp, ent) if entropy else logp
    if not torch.is_grad_enabled() or not (h_TxD.requires_grad or w_VxD.requires_grad):
        kern = _triton() if h_TxD.is_cuda else None
        if kern is not None:
            logp, ent, _ = kern.triton_head_forward(h_TxD, w_VxD, labels_T, t, entropy)
        else:
            logp, ent, _ = head_forward(
                h_TxD, w_VxD, labels_T, t, entropy, token_chunk=token_chunk, vocab_chunk=vocab_chunk
            )
        return (logp, ent) if entropy else logp
    logp, ent, _ = _FusedHead.apply(h_TxD, w_VxD, labels_T, t, bool(entropy), token_chunk, vocab_chunk)
    return (logp, ent) if entropy else logp


def unfused_head(
    h_TxD: torch.Tensor,
    w_VxD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The reference head through full fp32 logits (O(T×V) memory, plain autograd):
    ``(logp_T, entropy_T or None, logits_TxV or None)``, IGNORE rows 0 like ``fused_head``."""
    t = check_args(h_TxD, w_VxD, labels_T, temperature, None, None)
    z_TxV = F.linear(h_TxD, w_VxD).float()
    if t != 1.0:
        z_TxV = z_TxV / t
    logp_T = -F.cross_entropy(z_TxV, labels_T, reduction="none", ignore_index=IGNORE)
    ent_T = None
    if entropy:
        logq = z_TxV.log_softmax(-1)
        ent_T = -(logq.exp() * logq).sum(-1) * (labels_T != IGNORE)
    return logp_T, ent_T, z_TxV if logits else None
