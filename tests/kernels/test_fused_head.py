"""The fused head (``odcfn.kernels.fused_head``) equals the unfused head computed in float64 (full
logits): per-token logp and entropy, and gradients w.r.t. hidden states and head weight, for
random shapes (V below, above and not a multiple of the vocabulary chunk), temperatures, ignored
labels, and upstream gradients; through the loss seam for cross-entropy and policy-gradient
losses (tied and untied heads); bf16 within bf16's own error. Its peak memory stays below a
bound that one T×V buffer exceeds. Bad input is named.

Tolerances follow from fp32 arithmetic: a logit ``z = Σ_i h_i w_i / τ`` is off by at most about
``√D·ε·Σ_i|h_i w_i|/τ`` (ε = 2⁻²⁴), and the log-sum-exp, entropy and log-probs inherit that
absolute error ``κ_t`` per token (plus a few ε of their own magnitudes). A gradient entry
``Σ_v dz_v w_v / τ`` (or ``Σ_t dz_t h_t / τ``) is off by ``κ`` times the sum of the absolute
values of its terms, which the test computes from the float64 reference."""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

import odcfn
from odcfn import losses
from odcfn.kernels import fused_head as fused_head_module
from odcfn.kernels.fused_head import (
    IGNORE,
    default_chunks,
    fused_head,
    head_backward,
    head_forward,
    unfused_head,
)
from odcfn.model import unit_inputs
from odcfn.models import QwenConfig, init_params, qwen_model
from tests.rl_ref import rollout_batch

EPS32 = 2.0**-24


def _problem(T, V, D, seed, scale=1.0, ignore=0.2):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g, dtype=torch.float64) * scale
    w = torch.randn(V, D, generator=g, dtype=torch.float64) / math.sqrt(D) * 2
    y = torch.randint(0, V, (T,), generator=g)
    y[torch.rand(T, generator=g) < ignore] = IGNORE
    return h, w, y


def _kappa(h, w, tau):
    """Per-token absolute error bound of fp32 logits and what is computed from them."""
    zabs_T = (h.abs() @ w.abs().T).amax(1) / tau
    V, D = w.shape
    return EPS32 * (2 * math.sqrt(D) * zabs_T + 4 * (2 * zabs_T + math.log(V) + 1))


def _reference(h, w, y, tau, g_logp, g_ent):
    """float64: logp, entropy, and the gradients of Σ g_logp·logp + Σ g_ent·H w.r.t. h and W,
    plus the componentwise magnitudes ``|dz|·|W|/τ`` and ``|dz|ᵀ·|h|/τ`` of those gradients."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent, _ = unfused_head(h, w, y, temperature=tau, entropy=True)
    dh, dw = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (h, w))
    with torch.no_grad():
        logq = torch.log_softmax(h @ w.T / tau, -1)
        p = logq.exp()
        keep = (y != IGNORE).double()[:, None]
        onehot = torch.zeros_like(p)
        onehot[y != IGNORE, y[y != IGNORE]] = 1.0
        dz_abs = keep * (g_logp.abs()[:, None] * (onehot + p)
                         + g_ent.abs()[:, None] * p * (logq.abs() + ent[:, None].abs()))
        mag_dh = dz_abs @ w.abs() / tau
        mag_dw = dz_abs.T @ h.abs() / tau
    return logp.detach(), ent.detach(), dh, dw, mag_dh, mag_dw


def _no_fallback(*a, **k):
    raise AssertionError("fused_head took the small-problem fallback (unfused_head): not the tiled path")


def _check_against_float64(T, V, D, tau, tc, vc, scale, seed):
    """The fused head with chunks ``(tc, vc)`` against the float64 reference, within the fp32
    bounds above. The unfused fallback is patched to fail: what is checked is the tiled path."""
    h, w, y = _problem(T, V, D, seed, scale)
    g = torch.Generator().manual_seed(seed + 1)
    g_logp, g_ent = torch.randn(T, generator=g, dtype=torch.float64), torch.randn(T, generator=g).double()
    logp, ent, dh, dw, mag_dh, mag_dw = _reference(h, w, y, tau, g_logp, g_ent)
    hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
    with mock.patch.object(fused_head_module, "unfused_head", _no_fallback):
        got_lp, got_ent = fused_head(hf, wf, y, temperature=tau, entropy=True, token_chunk=tc, vocab_chunk=vc)
        got_dh, got_dw = torch.autograd.grad(
            (got_lp * g_logp.float()).sum() + (got_ent * g_ent.float()).sum(), (hf, wf))
    kappa = _kappa(h, w, tau)
    # the input's own fp32 rounding moves every logit by ~ε|z| too: inside kappa's 4·2·zabs term
    c = 8.0
    err_lp, err_ent = (got_lp.double() - logp).abs(), (got_ent.double() - ent).abs()
    assert (err_lp <= c * kappa).all(), float((err_lp / kappa).max())
    assert (err_ent <= c * kappa * (1 + ent.abs())).all(), float((err_ent / kappa).max())
    assert (got_lp[y == IGNORE] == 0).all() and (got_ent[y == IGNORE] == 0).all()
    k = c * (kappa.max() + EPS32 * math.log2(max(V, T) + 1))
    err_dh, err_dw = (got_dh.double() - dh).abs(), (got_dw.double() - dw).abs()
    assert (err_dh <= k * mag_dh).all(), float((err_dh / (k * mag_dh)).nan_to_num(0).max())
    assert (err_dw <= k * mag_dw).all(), float((err_dw / (k * mag_dw)).nan_to_num(0).max())
    assert not got_dh[y == IGNORE].any()


@settings(max_examples=12, deadline=None)
@given(
    T=st.integers(1, 3000),
    V=st.integers(2, 700),
    D=st.integers(1, 48),
    tau=st.sampled_from([1.0, 0.6, 1.7]),
    chunk=st.one_of(st.none(), st.tuples(st.integers(1, 600), st.integers(1, 800))),
    scale=st.sampled_from([0.3, 1.0, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_fused_head_equals_float64_full_logits(T, V, D, tau, chunk, scale, seed):
    # None: the default chunking made explicit (given chunks always take the tiled path; with
    # none given, a problem this small would run as one plain-autograd tile instead)
    tc, vc = chunk if chunk else default_chunks(T, V)
    _check_against_float64(T, V, D, tau, tc, vc, scale, seed)


@settings(max_examples=3, deadline=None)
@given(
    T=st.integers(65, 160),  # T·V > _SMALL: no chunk given and still the tiled path
    V=st.integers(16_385, 20_000),  # above one default vocabulary tile: the running rescale
    D=st.integers(1, 8),
    tau=st.sampled_from([1.0, 0.6]),
    seed=st.integers(0, 2**16),
)
def test_default_chunking_over_several_vocabulary_tiles(T, V, D, tau, seed):
    tc, vc = default_chunks(T, V)
    assert vc < V and tc == T, (tc, vc)  # several vocabulary tiles, one token tile
    _check_against_float64(T, V, D, tau, None, None, 1.0, seed)


def test_default_chunks_never_hold_t_by_v():
    for T, V in [(1, 2), (3000, 700), (32768, 151936), (65536, 128256), (8192, 4096)]:
        tc, vc = default_chunks(T, V)
        assert 1 <= tc <= T and 1 <= vc <= V and tc * vc <= max(1 << 23, V)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["ce", "pg", "pg_entropy_kl"])
def test_loss_seam_fused_equals_unfused_float64(kind, tied):
    """head_stats through the fused head (fp32) equals the unfused head in float64, in the loss
    value and the gradients w.r.t. the hidden states and the (tied) head weight."""
    cfg = QwenConfig(vocab_size=301, d_model=24, n_layers=0, n_heads=2, n_kv_heads=1, d_ff=8,
                     tie_embeddings=tied)
    batch = rollout_batch([40, 7, 95, 2, 60], [5, 1, 30, 0, 10], cfg.vocab_size, seed=3)
    # chunks given: the tiled path (a problem this small would otherwise run as one tile)
    loss = {"ce": losses.cross_entropy("seq-mean-token-mean", temperature=0.8, vocab_chunk=128),
            "pg": losses.policy_gradient(clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-sum",
                                         token_chunk=50),
            "pg_entropy_kl": losses.policy_gradient(kl_loss_coef=0.3, kl_loss_type="mse", entropy_coeff=0.1,
                                                    temperature=1.3, token_chunk=17, vocab_chunk=64)}[kind]
    model = qwen_model(cfg, dtype=torch.float64)
    params = init_params(cfg, seed=1, dtype=torch.float64)
    params["embed"]["embed_tokens"]["weight"] *= 20  # logits of a few units, not ~0
    weights = loss.weights(batch)
    mb = odcfn.pack(batch, range(len(batch)), loss=loss, weights=weights)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(mb.num_tokens, cfg.d_model, dtype=torch.float64, generator=g)
    head = model.units[-1]

    def run(dtype, which):
        p = odcfn.tree_map(lambda t: t.to(dtype).requires_grad_(), params)
        used = {"embed": p["embed"]} if tied else {}
        xx = x.to(dtype).requires_grad_()
        m = odcfn.pack(batch, range(len(batch)), loss=dataclasses.replace(loss, head=which), weights=weights)
        out = head.fwd(unit_inputs(head, p["head"], {**p, **used}), xx, m)
        w = p["embed"]["embed_tokens"]["weight"] if tied else p["head"]["lm_head"]["weight"]
        dx, dw = torch.autograd.grad(out[0], (xx, w))
        return out.detach().double(), dx.double(), dw.double()

    want, want_dx, want_dw = run(torch.float64, "unfused")
    got, got_dx, got_dw = run(torch.float32, "fused")
    # every term is O(1) here (|z| of a few units, |weights| <= 1, |grads| of the losses ~ few):
    # fp32 against float64 lands within ~1e-6 relative of each quantity's magnitude
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6 * float(want[0].abs()) + 1e-7)
    if kind != "ce":  # the entropy figure is a smooth sum too
        i = 1 + loss.metric_names.index("entropy")
        torch.testing.assert_close(got[i], want[i], rtol=2e-6, atol=1e-6)
    for g, w_ in ((got_dx, want_dx), (got_dw, want_dw)):
        torch.testing.assert_close(g, w_, rtol=0, atol=2e-6 * float(w_.abs().max()))


def test_bf16_within_bf16_error():
    """bf16 compute: the same result as the unfused head in bf16 (the practice being replaced),
    both against float64, within bf16's own error (logits rounded to 8 bits of mantissa)."""
    h, w, y = _problem(300, 500, 32, seed=7, scale=1.0)
    g = torch.randn(300, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    logp, ent, dh, dw, _, _ = _reference(h, w, y, 1.0, g, g)
    errs = {}
    for name, fn in (("fused", lambda hh, ww: fused_head(hh, ww, y, entropy=True, vocab_chunk=128)),
                     ("unfused", lambda hh, ww: unfused_head(hh, ww, y, entropy=True)[:2])):
        hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        lp, en = fn(hb, wb)
        gh, gw = torch.autograd.grad((lp * g.float()).sum() + (en * g.float()).sum(), (hb, wb))
        errs[name] = [float((a.detach().double() - b).abs().max() / b.abs().max())
                      for a, b in ((lp, logp), (en, ent), (gh, dh), (gw, dw))]
    for f, u in zip(errs["fused"], errs["unfused"]):
        assert f <= 2 * u + 2**-8, errs  # no worse than the unfused bf16 head (fp32 math, one dW)


def test_torch_contract_functions_match_the_op():
    """``head_forward``/``head_backward`` (the signatures the Triton kernel implements) give
    what the autograd op gives; backward without an entropy term ignores entropies."""
    h, w, y = _problem(70, 90, 8, seed=2)
    h, w = h.float(), w.float()
    gl, ge = torch.randn(70), torch.randn(70)
    lp, ent, lse = head_forward(h, w, y, 0.9, True)
    assert lse.dtype == torch.float32 and (lse[y == IGNORE] == 0).all()
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    a, b = fused_head(hh, ww, y, temperature=0.9, entropy=True, vocab_chunk=90)  # chunked: not one tile
    torch.testing.assert_close((a, b), (lp, ent), rtol=0, atol=0)
    want = torch.autograd.grad((a * gl).sum() + (b * ge).sum(), (hh, ww))
    got = head_backward(h, w, y, lse, ent, gl, ge, 0.9)
    assert got[0].dtype == h.dtype and got[1].dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    no_ent = head_backward(h, w, y, lse, None, gl, None, 0.9)
    want = torch.autograd.grad((fused_head(hh, ww, y, temperature=0.9, vocab_chunk=90) * gl).sum(), (hh, ww))
    torch.testing.assert_close(no_ent, want, rtol=0, atol=0)


def _peak_bytes(fn):
    """Peak bytes of tensors allocated while ``fn`` runs (live at once), from the profiler's
    allocator events: what the CPU allocator actually handed out."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        if e.name() == "[memory]":
            live += e.nbytes()
            peak = max(peak, live)
    return peak


def test_peak_memory_stays_below_one_t_by_v_buffer():
    T, V, D = 1024, 16384, 16
    h, w, y = _problem(T, V, D, seed=4, ignore=0.0)
    h, w = h.float(), w.float()
    t_by_v = T * V * 4  # one fp32 T×V tensor: 64 MiB

    def step(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = fn(hh, ww)
        ((lp + 0.1 * ent).sum()).backward()

    fused = _peak_bytes(lambda: step(lambda a, b: fused_head(a, b, y, entropy=True, token_chunk=256,
                                                              vocab_chunk=2048)))
    unfused = _peak_bytes(lambda: step(lambda a, b: unfused_head(a, b, y, entropy=True)[:2]))
    # fused: O(T) state, h/W copies and grads (~3 MiB), dW (1 MiB) and a few 2 MiB tiles
    assert fused < t_by_v / 4, (fused, t_by_v)
    assert unfused > t_by_v, (unfused, t_by_v)  # the measurement sees a T×V buffer when there is one


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=float("nan")), "temperature must be > 0"),
    (dict(temperature=-1.0), "temperature must be > 0"),
    (dict(token_chunk=0), "token_chunk must be an int >= 1"),
    (dict(vocab_chunk=-3), "vocab_chunk must be an int >= 1"),
])
def test_bad_settings_are_named(kw, match):
    h, w, y = _problem(5, 7, 3, seed=0)
    with pytest.raises(ValueError, match=match):
        fused_head(h.float(), w.float(), y, **kw)
    with pytest.raises(ValueError, match=match):
        (losses.cross_entropy if "chunk" in str(kw) else losses.policy_gradient)(**kw)


def test_labels_outside_the_vocabulary_are_named():
    h, w, y = _problem(5, 7, 3, seed=0, ignore=0.0)
    for bad in (7, -1, -101):
        yy = y.clone()
        yy[2] = bad
        with pytest.raises(ValueError, match=r"labels_T must lie in \[0, vocab_size=7\)"):
            fused_head(h.float(), w.float(), yy)
    with pytest.raises(ValueError, match="head must be one of"):
        losses.cross_entropy(head="triton")


def test_log_probs_go_straight_back_as_old_logprobs():
    """One alignment for every per-token array: ``log_probs``' output is the ``old_logprobs``
    extra as is, so the first update's ratio is exactly 1 (no clipping, ppo_kl 0)."""
    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16)
    model, params = qwen_model(cfg), init_params(cfg, seed=0)
    params["embed"]["embed_tokens"]["weight"] *= 50  # a peaked policy: a misalignment shows

    def fn(rank, tr):
        loss = losses.policy_gradient(clip_ratio_low=0.01, clip_ratio_high=0.01)
        state = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.sgd(0.0), transport=tr,
                                        config=odcfn.StepConfig(loss=loss))
        batch = rollout_batch([9, 5, 12], [2, 1, 3], cfg.vocab_size, seed=1)
        old = odcfn.log_probs(state, batch)
        samples = tuple(odcfn.Sample(s.tokens, loss_mask=s.loss_mask, extras={**s.extras, "old_logprobs": o})
                        for s, o in zip(batch.samples, old))
        return odcfn.train_step(state, odcfn.Batch(samples))[1].extra

    for extra in odcfn.run_local(fn, 2):
        assert abs(extra["ppo_kl"]) < 1e-6 and extra["pg_clipfrac"] == 0, extra
