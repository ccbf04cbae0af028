"""The fused head's Triton kernels, on CPU through triton's interpreter, against a float64
full-logits reference (and the torch chunked path where it is present), and compiled for
Hopper (sm_90) in a subprocess.

The interpreter is chosen when the kernels are *decorated*: this module imports
``odcfn.kernels.fused_head_triton`` with ``TRITON_INTERPRET=1`` (reloading it if another test
imported it compiled) and restores the variable afterwards. Shapes are small: the interpreter
runs ~1-2 ms per program whatever its size; the smallest ``tl.dot`` tiles (16) keep V not a
multiple of the tile, V below one tile, several vocabulary slices and IGNORE rows in play.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import subprocess
import sys

import pytest
import torch
import triton  # the gpu extra: a hard requirement of these tests
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

_saved = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import odcfn.kernels.fused_head_triton as K

    if not K.interpreting():
        K = importlib.reload(K)
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved


def reference(h, w, y, tau, g_logp, g_ent):
    """float64 full logits through autograd: logp, entropy, and the gradients of
    Σ g_logp·logp + Σ g_ent·H w.r.t. h and W; IGNORE (-100) rows give 0 and no gradient."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    keep = y != -100
    z = (h64 @ w64.T) / tau
    logq = z.log_softmax(-1)
    logp = torch.where(keep, logq.gather(1, y.clamp(min=0)[:, None])[:, 0], 0.0)
    ent = torch.where(keep, -(logq.exp() * logq).sum(-1), 0.0)
    (g_logp.double() * logp + g_ent.double() * ent).sum().backward()
    return logp, ent, h64.grad, w64.grad


def _case(T, V, D, seed, ignore_frac=0.25, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, D, generator=g) * scale).to(dtype)
    w = (torch.randn(V, D, generator=g) * scale).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    y[torch.rand(T, generator=g) < ignore_frac] = -100
    g_logp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return h, w, y, g_logp, g_ent


def _check(T, V, D, tau, entropy, seed, splits=None, rtol=1e-5):
    h, w, y, g_logp, g_ent = _case(T, V, D, seed)
    if not entropy:
        g_ent = torch.zeros_like(g_ent)
    logp, ent, lse = K.triton_head_forward(h, w, y, tau, entropy, splits=splits)
    r_logp, r_ent, r_dh, r_dw = reference(h, w, y, tau, g_logp, g_ent)
    # tolerances: fp32 sums of D products and of V exponentials, relative to the values' scale
    torch.testing.assert_close(logp.double(), r_logp, rtol=rtol, atol=rtol * 10)
    assert ((y == -100) <= (lse == 0)).all()
    if entropy:
        torch.testing.assert_close(ent.double(), r_ent, rtol=rtol, atol=rtol * 10)
    else:
        assert ent is None
    dh, dw = K.triton_head_backward(h, w, y, lse, ent, g_logp, g_ent if entropy else None, tau)
    assert dh.dtype == h.dtype and dw.dtype == torch.float32
    torch.testing.assert_close(dh.double(), r_dh, rtol=rtol, atol=rtol * r_dh.abs().max().item())
    torch.testing.assert_close(dw.double(), r_dw, rtol=rtol, atol=rtol * r_dw.abs().max().item())
    assert (dh[y == -100] == 0).all()


@pytest.mark.parametrize(
    "T,V,D,tau,entropy",
    [
        (37, 100, 24, 1.0, True),  # V not a multiple of the tile, D not a multiple of 16
        (20, 7, 16, 0.7, True),  # V below one tile
        (33, 130, 40, 1.9, False),  # several slices, no entropy term
    ],
)
def test_matches_float64_reference(T, V, D, tau, entropy):
    _check(T, V, D, tau, entropy, seed=T + V)


@settings(max_examples=6, deadline=None)
@given(
    T=st.integers(1, 40), V=st.integers(1, 90), D=st.integers(1, 40),
    tau=st.floats(0.3, 3.0), entropy=st.booleans(), splits=st.integers(1, 4), seed=st.integers(0, 999),
)  # fmt: skip
def test_property_matches_float64_reference(T, V, D, tau, entropy, splits, seed):
    _check(T, V, D, tau, entropy, seed, splits=splits)


def test_all_rows_ignored():
    h, w, y, g_logp, g_ent = _case(5, 20, 16, 0, ignore_frac=1.0)
    logp, ent, lse = K.triton_head_forward(h, w, y, 1.0, True)
    assert not logp.any() and not ent.any() and not lse.any()
    dh, dw = K.triton_head_backward(h, w, y, lse, ent, g_logp, g_ent, 1.0)
    assert not dh.any() and not dw.any()


def test_large_logits_stay_finite():
    # logits of size ~100: exp would overflow without the running max
    h, w, y, g_logp, g_ent = _case(24, 50, 16, 5, scale=3.0)
    logp, ent, lse = K.triton_head_forward(h, w, y, 0.5, True)
    r_logp, r_ent, _, _ = reference(h, w, y, 0.5, g_logp, g_ent)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(logp.double(), r_logp, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(ent.double(), r_ent, rtol=1e-4, atol=1e-3)


def test_bf16_within_bf16_error():
    """bf16 h and W: tensor-core dots, dz rounded to bf16 for the gradient dots, as autograd's
    bf16 backward does; compared with the float64 reference of the same bf16 values."""
    h, w, y, g_logp, g_ent = _case(32, 70, 32, 3, dtype=torch.bfloat16, scale=0.5)
    logp, ent, lse = K.triton_head_forward(h, w, y, 1.0, True)
    r_logp, r_ent, r_dh, r_dw = reference(h, w, y, 1.0, g_logp, g_ent)
    torch.testing.assert_close(logp.double(), r_logp, rtol=1e-4, atol=1e-4)  # fp32 accumulation
    torch.testing.assert_close(ent.double(), r_ent, rtol=1e-4, atol=1e-4)
    dh, dw = K.triton_head_backward(h, w, y, lse, ent, g_logp, g_ent, 1.0)
    assert dh.dtype == torch.bfloat16
    # dz and dh rounded to bf16 (2^-8 relative each): a few bf16 ulps of the largest entry
    torch.testing.assert_close(dh.double(), r_dh, rtol=2e-2, atol=2e-2 * r_dh.abs().max().item())
    torch.testing.assert_close(dw.double(), r_dw, rtol=2e-2, atol=2e-2 * r_dw.abs().max().item())


def test_matches_the_torch_chunked_path():
    from odcfn.kernels import fused_head as fh

    h, w, y, g_logp, g_ent = _case(29, 75, 20, 11)
    got = K.triton_head_forward(h, w, y, 0.8, True)
    want = fh.head_forward(h, w, y, 0.8, True, token_chunk=7, vocab_chunk=16)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    args = (h, w, y, want[2], want[1], g_logp, g_ent, 0.8)
    for a, b in zip(K.triton_head_backward(*args), fh.head_backward(*args, token_chunk=7, vocab_chunk=16)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_backward_owns_its_outputs_no_atomics_and_repeats_bit_for_bit():
    """dW: one program per vocabulary tile walks the tokens; dh: one per token block (and
    vocabulary slice, partials summed in order). No atomics anywhere in the backward, so two
    runs agree bit for bit, and the slice count only changes dh's fp32 summation order."""
    import inspect

    for k in (K._head_bwd_dw_kernel, K._head_bwd_dh_kernel, K._tile_dz):
        src = inspect.getsource(getattr(k, "fn", k))
        assert "atomic" not in src.split('"""')[-1], k
    h, w, y, g_logp, g_ent = _case(45, 83, 24, 5)
    _, ent, lse = K.triton_head_forward(h, w, y, 1.1, True)
    runs = [K.triton_head_backward(h, w, y, lse, ent, g_logp, g_ent, 1.1, splits=s) for s in (1, 3, 3)]
    assert torch.equal(runs[1][0], runs[2][0]) and torch.equal(runs[1][1], runs[2][1])
    assert torch.equal(runs[0][1], runs[1][1])  # dW's order never depends on the slices
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-6, atol=1e-6)


@contextlib.contextmanager
def _programs_in_order(seed: int):
    """Every launch inside runs its grid's programs in a shuffled order (``seed``) instead of the
    interpreter's row-major one: what a GPU's scheduler may do from one run to the next. Output
    written by one program per element in a fixed loop order cannot depend on it; sums through
    atomics do (``_atomic_sum`` below is the positive control)."""
    import triton.runtime.interpreter as interp

    b = interp.interpreter_builder
    set_dim, set_idx = b.set_grid_dim, b.set_grid_idx
    order: list = []

    def dim(x, y, z):
        order[:] = [(i, j, k) for i in range(x) for j in range(y) for k in range(z)]
        random.Random(seed).shuffle(order)
        order.reverse()  # popped from the end: the shuffled order from its start
        set_dim(x, y, z)

    def idx(x, y, z):
        set_idx(*order.pop())

    b.set_grid_dim, b.set_grid_idx = dim, idx
    try:
        yield
    finally:
        del b.set_grid_dim, b.set_grid_idx  # the class's methods again


def _atomic_sum_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    tl.atomic_add(out_ptr + cols, tl.load(x_ptr + pid * BLOCK + cols))


os.environ["TRITON_INTERPRET"] = "1"  # decorated now, so interpreted (as the kernels above)
try:
    _atomic_sum = triton.jit(_atomic_sum_kernel)
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved


def test_kernels_are_bit_identical_whatever_order_their_programs_run_in():
    """Issue 40, item 10: deterministic mode takes the fused head on CUDA because no output
    element of the forward or backward depends on the order in which the GPU runs programs.
    Under the interpreter the programs of every launch run in shuffled orders: the outputs are
    equal bit for bit. The control: a sum through ``tl.atomic_add`` run the same way changes bits
    (so the shuffling does reorder what an atomic kernel would add)."""
    h, w, y, g_logp, g_ent = _case(45, 83, 24, 7)

    def run():
        logp, ent, lse = K.triton_head_forward(h, w, y, 1.3, True, splits=3)
        dh, dw = K.triton_head_backward(h, w, y, lse, ent, g_logp, g_ent, 1.3, splits=3)
        return logp, ent, lse, dh, dw

    base = run()
    for seed in (1, 2, 3):
        with _programs_in_order(seed):
            got = run()
        assert all(torch.equal(a, b) for a, b in zip(base, got)), seed

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g) * torch.logspace(-4, 4, 64)[:, None]  # mixed magnitudes

    def atomic():
        out = torch.zeros(16)
        with K._INTERPRETER_LOCK:
            _atomic_sum[(64,)](x, out, BLOCK=16)
        return out

    plain = atomic()
    torch.testing.assert_close(plain.double(), x.double().sum(0), rtol=1e-5, atol=1e-3)
    shuffled = []
    for seed in (1, 2, 3):
        with _programs_in_order(seed):
            shuffled.append(atomic())
    assert any(not torch.equal(plain, s) for s in shuffled)  # the order reaches an atomic sum


FUSED = ["fused_head_fwd[bf16]", "fused_head_bwd[bf16]", "fused_head_bwd_dh[bf16]"]


def test_kernels_compile_for_sm90():
    """The bf16 kernels (what training on a GPU runs) compiled for Hopper in a subprocess
    (TRITON_INTERPRET unset there): a cubin, nothing left to link. ptxas's register spills are
    bounded loosely (0 and 2 STL/LDL when written; a bad tile shape spills hundreds): the tiles
    are not tuned on hardware yet. (The fp32 variants compile
    too, in ``python -m odcfn.transport.gpu._compile``; they take minutes on two cores.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "-m", "odcfn.transport.gpu._compile", "90", ",".join(FUSED)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {d["name"]: d for d in map(json.loads, p.stdout.splitlines())}
    assert set(rows) == set(FUSED), sorted(rows)
    for name, d in rows.items():
        assert d["cubin_bytes"] > 10_000 and d["calls"] == [] and d["externs_unresolved"] == [], (name, d)
        assert d["sass_local"] <= 16, (name, d["sass_local"])
