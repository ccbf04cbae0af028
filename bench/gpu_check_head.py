"""GPU check section ``fused_head``: the fused head's Triton kernels against the torch chunked
path and a float64 full-logits reference (correctness), then time and peak memory of one
forward+backward of the head at a real vocabulary for: the Triton kernels, the torch chunked
path, and the unfused head (full fp32 logits + cross-entropy through autograd).

On CPU (``--device cpu`` under ``TRITON_INTERPRET=1``) it runs tiny shapes through the
interpreter: a dry run of the code path, no timing worth reading.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def _ref64(h, w, y, tau, g_logp, g_ent):
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    keep = y != -100
    logq = ((h64 @ w64.T) / tau).log_softmax(-1)
    logp = torch.where(keep, logq.gather(1, y.clamp(min=0)[:, None])[:, 0], 0.0)
    ent = torch.where(keep, -(logq.exp() * logq).sum(-1), 0.0)
    (g_logp.double() * logp + g_ent.double() * ent).sum().backward()
    return logp, ent, h64.grad, w64.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(T, V, D, dtype, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, D, generator=g) * 0.5).to(dev, dtype)
    w = (torch.randn(V, D, generator=g) * 0.05).to(dev, dtype)
    y = torch.randint(0, V, (T,), generator=g)
    y[torch.rand(T, generator=g) < 0.2] = -100
    return h, w, y.to(dev), torch.randn(T, generator=g).to(dev), torch.randn(T, generator=g).to(dev)


def _measure(fn, dev) -> tuple[float, int]:
    """Seconds per call (after one warm-up) and peak bytes allocated above the start."""
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3, torch.cuda.max_memory_allocated() - base
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t, -1


def _paths(h, w, y, gl, ge) -> dict:
    """One forward+backward of the head (with entropy) by each path, as callables."""
    from odcfn.kernels import fused_head as TH
    from odcfn.kernels import fused_head_triton as K

    def triton_path():
        logp, ent, lse = K.triton_head_forward(h, w, y, 1.0, True)
        K.triton_head_backward(h, w, y, lse, ent, gl, ge, 1.0)

    def torch_path():
        logp, ent, lse = TH.head_forward(h, w, y, 1.0, True)
        TH.head_backward(h, w, y, lse, ent, gl, ge, 1.0)

    def unfused():
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        z = F.linear(hh, ww).float()
        logp = -F.cross_entropy(z, y, reduction="none", ignore_index=-100)
        logq = z.log_softmax(-1)
        ent = -(logq.exp() * logq).sum(-1)
        torch.autograd.backward([(logp * gl).sum() + (ent * ge).sum()])

    return {"triton": triton_path, "torch_chunked": torch_path, "unfused": unfused}


def correctness(dev: torch.device) -> tuple[list[str], dict]:
    """The Triton kernels vs float64 (fp32: tight; bf16) and vs the torch chunked path at a small
    shape: ``(failures, relative errors)``. The GPU check's first-minute path and its section."""
    from odcfn.kernels import fused_head as TH
    from odcfn.kernels import fused_head_triton as K

    bad: list[str] = []
    out: dict = {}
    small = (300, 5000, 128) if dev.type == "cuda" else (20, 40, 16)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        h, w, y, gl, ge = _inputs(*small, dtype, dev)
        logp, ent, lse = K.triton_head_forward(h, w, y, 0.9, True)
        dh, dw = K.triton_head_backward(h, w, y, lse, ent, gl, ge, 0.9)
        r = _ref64(h.cpu(), w.cpu(), y.cpu(), 0.9, gl.cpu(), ge.cpu())
        errs = {k: _rel(a.cpu(), b) for k, a, b in
                zip(("logp", "entropy", "dh", "dw"), (logp, ent, dh, dw), r)}  # fmt: skip
        tl_, tent, tlse = TH.head_forward(h, w, y, 0.9, True)
        tdh, tdw = TH.head_backward(h, w, y, tlse, tent, gl, ge, 0.9)
        names, ours, theirs = ("logp", "entropy", "dh", "dw"), (logp, ent, dh, dw), (tl_, tent, tdh, tdw)
        errs |= {f"{k}_vs_torch": _rel(a, b) for k, a, b in zip(names, ours, theirs)}
        out[str(dtype)] = errs
        worst = max(errs[k] for k in ("logp", "entropy", "dh", "dw"))
        if not worst < tol:
            bad.append(f"{dtype}: worst relative error vs float64 {worst:.2e} (tolerance {tol:.0e})")
    return bad, out


def fused_head(dev: torch.device) -> tuple[str, str, dict]:
    # correctness: fp32 vs float64 (tight), bf16 vs the torch chunked path on the same inputs
    bad, errs = correctness(dev)
    data: dict = {"correctness": errs, "speed": {}}
    # speed and memory at a real vocabulary: one forward+backward of the head
    shapes = [(4096, 151936, 896), (16384, 151936, 896)] if dev.type == "cuda" else [(16, 40, 16)]
    for T, V, D in shapes:
        row = {}
        for name, fn in _paths(*_inputs(T, V, D, torch.bfloat16, dev, seed=1)).items():
            try:
                s, peak = _measure(fn, dev)
                row[name] = {"s": s, "peak_bytes": peak}
            except torch.OutOfMemoryError as e:
                row[name] = {"error": str(e).splitlines()[0][:200]}
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        data["speed"][f"T={T},V={V},D={D},bf16"] = row
    detail = "triton head vs float64 (fp32, bf16) and the torch chunked path; " + ", ".join(
        f"{k}: " + " / ".join(f"{n} {r['s'] * 1e3:.1f} ms {r['peak_bytes'] / 2**30:.2f} GiB"
                              if "s" in r else f"{n} OOM" for n, r in row.items())
        for k, row in data["speed"].items()
    )
    return ("fail", "; ".join(bad), data) if bad else ("pass", detail, data)
