"""``deterministic=True`` in bounded memory: each microbatch's gradient is pushed when its turn in
the fixed (microbatch slot, rank) order comes, interleaved with compute, instead of summing an
unsharded fp32 gradient of every unit per rank until the sync; the staged bytes stay under the
window (plus one gradient), and uneven microbatch counts stay bit-identical whatever the timing."""

from __future__ import annotations

import random
import time

import pytest
import torch

import odcfn
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.step import ordered_push, run
from tests.util import make_state

CFG = QwenConfig(vocab_size=41, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
LENGTHS = [9, 14, 5, 11, 7, 13, 6]  # round robin at W=3, cap 16: 3, 2 and 2 microbatches


def _run(monkeypatch, window, seed=0):
    pushers = []

    class Recorded(ordered_push.OrderedPusher):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "window": window})
            pushers.append(self)

    monkeypatch.setattr(run, "OrderedPusher", Recorded)  # where the step builds its pusher
    model, full = qwen_model(CFG), init_params(CFG, seed=0)
    batch = odcfn.random_batch(LENGTHS, CFG.vocab_size, seed=1)
    rng = random.Random(seed)

    def fn(rank, tr):
        log, push, gather = [], tr.scatter_accumulate, tr.gather

        def pushed(unit, grad):
            time.sleep(rng.random() * 1e-3)  # another timing every run
            log.append("push")
            return push(unit, grad)

        def gathered(unit, out):
            log.append("gather")
            return gather(unit, out)

        tr.scatter_accumulate, tr.gather = pushed, gathered
        state = make_state(
            full, model, tr, odcfn.adamw(1e-2), max_tokens_per_microbatch=16, deterministic=True
        )
        state, _ = odcfn.train_step(state, batch)
        return {k: v.clone() for k, v in state.params.items()}, log

    out = odcfn.run_local(fn, 3)
    return [p for p, _ in out], [log for _, log in out], pushers, model


def test_pushes_interleave_with_compute_and_staging_stays_bounded(monkeypatch):
    params, logs, pushers, model = _run(monkeypatch, window=0)
    # rank 0 holds the first turn of every microbatch slot, so its first microbatch's pushes go
    # out before its later microbatches' gathers: not all held to the sync. (Another rank may
    # wait for its turn past its last gather when the machine is loaded: timing, not a defect.)
    log = logs[0]
    assert log.index("push") < len(log) - 1 - log[::-1].index("gather"), log
    unit_bytes = max(u.padded_numel for u in odcfn.make_layout(model, odcfn.Mesh(3, 0)).units) * 4
    whole = sum(u.padded_numel for u in odcfn.make_layout(model, odcfn.Mesh(3, 0)).units) * 4
    assert len(pushers) == 3  # one per rank: the recorded class is the one the step built
    for p in pushers:
        assert 0 < p.peak <= unit_bytes < whole, (p.peak, unit_bytes, whole)


@pytest.mark.parametrize("window", [0, 1 << 30])
def test_uneven_microbatch_counts_are_bit_identical_whatever_the_timing(monkeypatch, window):
    runs = [_run(monkeypatch, window, seed)[0] for seed in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_deterministic_takes_the_fused_head_on_cuda_and_names_what_cuda_still_needs(monkeypatch):
    """Issue 40, item 10: the Triton head's backward has no atomics (tests/kernels/
    test_fused_head_triton.py runs its programs in shuffled orders), so deterministic mode takes
    the fused head on CUDA. What CUDA still needs is torch's own switch: without it torch's
    attention backward sums with atomics, and the refusal says so (for either head)."""
    from odcfn.kernels import fused_head

    monkeypatch.setattr(fused_head, "_triton", lambda: object())  # as if the Triton kernel served
    cuda, fused = torch.device("cuda"), odcfn.losses.cross_entropy()
    unfused = odcfn.losses.cross_entropy(head="unfused")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: False)
    ordered_push.check_head(fused, cuda)  # accepted: no atomics in its backward
    ordered_push.check_head(unfused, cuda)
    for warn_only, enabled in ((False, False), (True, True)):  # off, or on but only warning
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda e=enabled: e)
        monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda w=warn_only: w)
        for loss in (fused, unfused):
            match = r"use_deterministic_algorithms\(True\).*scaled_dot_product_attention"
            with pytest.raises(ValueError, match=match):
                ordered_push.check_head(loss, cuda)
    ordered_push.check_head(fused, torch.device("cpu"))  # the torch path: nothing to switch on
