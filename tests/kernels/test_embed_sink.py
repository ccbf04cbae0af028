"""The embedding's gradient lands in the unit's flat gradient (``odcfn.kernels.embedding``):
``F.embedding``'s gradient (padding row included), and no dense V×D gradient besides the flat
gradient itself, alone or tied to the head (``grad_sink.seed``), in one op and in a whole step.

Memory is counted as live tensor bytes op by op (``tests/memtrack.TensorBytes``)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import odcfn
from odcfn.kernels.embedding import embedding
from odcfn.kernels.grad_sink import flat_views, seed
from odcfn.losses import cross_entropy
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.models.layers import embed_fwd
from tests.memtrack import TensorBytes
from tests.util import ref_shards, run_grad_step

V, D, T = 4096, 64, 200
SHAPES = ((V, D), (D,))  # an embed unit's weight, then something else in the same flat buffer


def _ids(pad: int | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (T,), generator=g)  # few rows: many repeated tokens
    if pad is not None:
        ids[::7] = pad % V
    return ids


def _upstream(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(4)).to(dtype)


def _flat(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(V * D + D + 5, generator=g) * 0.1).to(dtype).requires_grad_()


def _want(flat: torch.Tensor, pad: int | None) -> torch.Tensor:
    """The flat gradient through ``F.embedding`` on plain views (the reference)."""
    flat = flat.detach().requires_grad_()
    w = flat[: V * D].view(V, D)
    out = F.embedding(_ids(pad), w, padding_idx=pad)
    (g,) = torch.autograd.grad(out, [flat], _upstream(flat.dtype))
    return g


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [None, 0, 7, -1])
def test_embedding_gives_f_embeddings_gradient(dtype, pad):
    flat = _flat(dtype)
    want = _want(flat, pad)
    # through the sink: rows added into the flat gradient, the padding row untouched
    w, _ = flat_views(flat, (V * D, D), SHAPES)
    out = embedding(_ids(pad), w, pad)
    torch.testing.assert_close(out, F.embedding(_ids(pad), w.detach(), padding_idx=pad))
    (got,) = torch.autograd.grad(out, [flat], _upstream(dtype))
    assert got.dtype == dtype and got.shape == flat.shape
    # bf16: rounded once per row here, while F.embedding's bf16 backward rounds as it sums
    # repeated tokens (its error against fp64 is the larger of the two): compare by norm
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _err(got, want) < tol, _err(got, want)
    if pad is not None:
        assert got[: V * D].view(V, D)[pad % V].eq(0).all()
        assert want[: V * D].view(V, D)[pad % V].eq(0).all()
        assert (_ids(pad) == pad % V).any()  # the pad token was used: its row was really skipped
    # plain tensor (no sink): the dense gradient, as F.embedding's
    w2 = flat.detach()[: V * D].view(V, D).clone().requires_grad_()
    (g2,) = torch.autograd.grad(embedding(_ids(pad), w2, pad), [w2], _upstream(dtype))
    assert g2.dtype == dtype and _err(g2, want[: V * D].view(V, D)) < tol


def test_embedding_under_torch_func_grad():
    """The reference differentiates with ``torch.func``: the Function must work under it."""
    w = torch.randn(V, D, generator=torch.Generator().manual_seed(6))
    up = _upstream(torch.float32)
    got = torch.func.grad(lambda w: (embedding(_ids(7), w, 7) * up).sum())(w)
    want = torch.func.grad(lambda w: (F.embedding(_ids(7), w, padding_idx=7) * up).sum())(w)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def _backward_peak(tied: bool) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """Peak live bytes of the embed unit's backward (``embed_fwd``, what the step runs)."""
    flat = _flat(torch.float32)
    w, _ = flat_views(flat, (V * D, D), SHAPES)
    out = embed_fwd({"embed_tokens": {"weight": w}}, None, SimpleNamespace(input_ids_T=_ids(None)))
    head = None
    if tied:  # the head's gradient of the same matrix, already computed (the executor's ``shared``)
        head = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(8))
        assert seed(flat, head)
    with TensorBytes() as m:
        (g,) = torch.autograd.grad(out, [flat], _upstream(torch.float32))
    return m.peak, g, head


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_backward_holds_no_dense_gradient(tied):
    vxd = V * D * 4
    peak, g, head = _backward_peak(tied)
    rows = 3 * T * D * 4  # the token rows' gradient and index: T×D-sized, not V×D
    if tied:
        # the head's buffer IS the flat gradient: nothing V×D-sized allocated at all
        assert g.data_ptr() == head.data_ptr()
        assert peak < rows, (peak, vxd)
    else:
        # the flat gradient (V×D and a bit) plus rows; before, F.embedding's dense dW besides it
        assert peak < vxd + 4 * (D + 5) + rows < 2 * vxd, (peak, vxd)
    want = _want(_flat(torch.float32), None)
    if tied:  # the head's part, as seeded (the buffer itself now holds the sum)
        want = want + torch.randn(want.numel(), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)


def test_seed_refuses_what_does_not_fit():
    flat = _flat(torch.float32)
    flat_views(flat, (V * D, D), SHAPES)
    assert not seed(flat, torch.zeros(flat.numel() - 1))  # wrong size
    assert not seed(flat, torch.zeros(flat.numel(), dtype=torch.float64))  # wrong dtype
    assert not seed(flat, torch.zeros(2, flat.numel())[:, 0])  # not contiguous
    assert not seed(flat.detach().clone(), torch.zeros(flat.numel()))  # no sink


# --- the whole step ------------------------------------------------------------------------------

BIG = QwenConfig(vocab_size=151_936, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)


@pytest.mark.parametrize("tied", [False, True])
def test_step_peak_is_two_vxd(tied):
    """A whole step at a real vocabulary (V×D dominates everything else at D=64, 64 tokens):
    the peak is the embed unit's backward, its gathered weights and ONE gradient. Before the
    embedding wrote into the sink it also held F.embedding's dense gradient (3 V×D), and tied
    the head's gradient of the same matrix too (4 V×D)."""
    cfg = replace(BIG, tie_embeddings=tied)
    model, params = qwen_model(cfg), init_params(cfg)
    config = odcfn.StepConfig(balance="round_robin", remat=True, loss=cross_entropy(), donate=True)
    state = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.adamw(1e-4),
                                    transport=odcfn.LocalWorld(1).transport(0), config=config)

    def batch(n: int) -> odcfn.Batch:
        return odcfn.Batch((odcfn.Sample(torch.randint(0, cfg.vocab_size, (n,),
                                                       generator=torch.Generator().manual_seed(n))),))

    state, _ = odcfn.train_step(state, batch(16))  # moments and accumulators exist before
    # resizes: the step frees each gathered buffer in place (resize_(0)) after its backward
    with TensorBytes(resizes=True) as m:
        odcfn.train_step(state, batch(64))
    vxd = cfg.vocab_size * cfg.d_model * 4
    assert 1.9 * vxd < m.peak < 2.5 * vxd, m.peak / vxd


@pytest.mark.parametrize("tied", [False, True])
def test_step_with_padding_row_equals_reference(tied):
    """A pad id (its row gets no gradient from its use) and a tied head, through the sink, on
    2 ranks: the reference's gradient."""
    cfg = QwenConfig(vocab_size=29, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
                     pad_token_id=3, tie_embeddings=tied)
    model, full = qwen_model(cfg), init_params(cfg, seed=2)
    samples = []
    for i, n in enumerate([7, 12, 5, 9]):
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(i))
        ids[1::3] = 3  # the pad token used as an input
        samples.append(odcfn.Sample(ids))
    batch = odcfn.Batch(tuple(samples))
    _, g_ref = odcfn.reference_value_and_grad(model, full, batch)
    emb = g_ref["embed"]["embed_tokens"]["weight"]
    if not tied:  # untied, the pad row's only gradient is its embedding use's: none
        assert emb[3].eq(0).all()
    else:  # tied, the head's use of row 3 gives it a gradient
        assert emb[3].ne(0).any()
    want = ref_shards(g_ref, model, 2)
    for comm in ("odc", "collective"):
        for rank, (grads, _) in enumerate(run_grad_step(full, batch, model, 2, comm=comm,
                                                        max_tokens_per_microbatch=12)):
            odcfn.tree_assert_allclose(grads, want[rank], rtol=2e-4, atol=2e-6, what=f"{comm} {rank}")
