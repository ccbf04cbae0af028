"""Traces: bubble rate, throughput, Chrome/Perfetto export and the timeline PNG, on events from
hand-made lists, the simulator and the real runtime alike."""

from __future__ import annotations

import json

import pytest

from odcfn.trace import (
    Event,
    bubble_rate,
    chrome_trace,
    makespan,
    plot_timeline,
    samples_per_s,
    save_chrome_trace,
    tokens_per_s,
)

# rank 0 computes 3 of 4 s (its gather is not compute), rank 1 (a slow device) 2.5 of 4 s
EVENTS = (
    (
        Event(0, "gather", "a", 0.0, 0.5),
        Event(0, "forward", "a", 0.5, 1.5, 0),
        Event(0, "backward", "a", 1.5, 3.5, 0),
        Event(0, "sync", "", 3.5, 4.0),
    ),
    (
        Event(1, "forward", "a", 0.0, 1.5, 0),
        Event(1, "backward", "a", 1.5, 2.5, 0),
        Event(1, "sync", "", 2.5, 4.0),
    ),
)


def test_bubble_rate_and_throughput_by_hand():
    assert makespan(EVENTS[0]) == 4.0
    assert bubble_rate(EVENTS) == pytest.approx(1 - (3.0 + 2.5) / (2 * 4.0))
    assert bubble_rate(EVENTS, step_time=5.0) == pytest.approx(1 - 5.5 / 10.0)
    assert samples_per_s(8, EVENTS) == 2.0
    assert tokens_per_s(1000, step_time=4.0) == 250.0
    with pytest.raises(ValueError, match="at least one rank"):
        bubble_rate([])
    with pytest.raises(ValueError, match="at least one rank"):
        samples_per_s(3)


def test_chrome_trace_structure(tmp_path):
    trace = chrome_trace(EVENTS)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == sum(len(evs) for evs in EVENTS)
    fwd = next(e for e in xs if e["pid"] == 0 and e["cat"] == "forward")
    assert fwd["ts"] == 0.5e6 and fwd["dur"] == 1.0e6 and fwd["name"] == "forward a mb0"
    assert fwd["tid"] == 0  # compute lane
    assert next(e for e in xs if e["cat"] == "gather")["tid"] == 1  # communication lane
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    path = tmp_path / "t.json"
    save_chrome_trace(EVENTS, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))


def test_timeline_png(tmp_path):
    path = tmp_path / "timeline.png"
    plot_timeline(EVENTS, path, title="hand")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000
    with pytest.raises(ValueError, match="at least one rank"):
        plot_timeline([], tmp_path / "x.png")


def _compute(evs):
    return sorted((e.kind, e.name, e.mb) for e in evs if e.kind in ("forward", "backward"))


def test_simulator_and_runtime_events_share_one_format(tmp_path):
    """A real 2-rank grad_step's events and the simulator's for the same plans go through the
    same functions; each reports every compute step of its plan exactly once."""
    import torch

    import odcfn
    from odcfn.models import QwenConfig, init_params, qwen_model
    from odcfn.models.slow import slow_model
    from odcfn.schedule.cost import TokenCost
    from odcfn.schedule.simulate import Workload, simulate
    from tests.util import make_state

    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=24)
    model, full = qwen_model(cfg), init_params(cfg)
    lengths = [6, 3, 9, 4]
    batch = odcfn.random_batch(lengths, cfg.vocab_size)

    def fn(rank, tr):
        torch.set_num_threads(1)
        slow = slow_model(model, 1.5 if rank else 1.0)
        _, m = odcfn.grad_step(make_state(full, slow, tr, balance="lb_mini"), batch)
        return m

    metrics = odcfn.run_local(fn, 2, timeout=30)
    real = [m.events for m in metrics]
    sim = simulate(
        [m.plan for m in metrics],
        lengths,
        workload=Workload(model.unit_names),
        cost=TokenCost(),
        slowdown=[1.0, 1.5],
    )
    for evs_real, evs_sim, m in zip(real, sim.events, metrics):
        assert _compute(evs_real) == _compute(evs_sim)
        n_compute = m.plan.count(odcfn.schedule.Forward) + m.plan.count(odcfn.schedule.Backward)
        assert len(_compute(evs_real)) == n_compute
    for evs in (real, sim.events):
        assert 0.0 <= bubble_rate(evs) < 1.0
        trace = chrome_trace(evs)
        assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    plot_timeline(real, tmp_path / "real.png", title="runtime")
    assert (tmp_path / "real.png").stat().st_size > 5000
