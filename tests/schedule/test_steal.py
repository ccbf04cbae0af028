"""The work-stealing protocol (odcfn.schedule.steal) on its own: whatever order the ranks' decisions
interleave in, every sample runs exactly once, owners run their lists in order, and nobody steals
from ranks that keep pace."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odcfn.schedule.balance import lb_mini
from odcfn.schedule.cost import TokenCost
from odcfn.schedule.plan import Forward, Gather, ScheduleOptions, Sync, compile_plan
from odcfn.schedule.program import Action, owner_steps, realised_plan
from odcfn.schedule.steal import ArrayCounters, steal_plan
from odcfn.schedule.steal import rank_program as program

TOK = TokenCost()


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5),
    st.lists(st.integers(1, 40), min_size=1, max_size=20),
    st.integers(0, 2**32 - 1),
    st.sampled_from([None, 0.0, 0.1, 1.0]),
    st.sampled_from([0.0, 0.3, 1.0]),
)
def test_any_interleaving_runs_every_sample_exactly_once(world, lengths, seed, tolerance, tail):
    sp = steal_plan(lengths, world, 40, cost=TOK, split_tail=tail)
    fa = ArrayCounters(sp.num_counters)
    progs = [program(sp, fa, r, tolerance=tolerance) for r in range(world)]
    actions: list[list] = [[] for _ in range(world)]
    live = list(range(world))
    rng = random.Random(seed)
    while live:  # a random scheduler: any rank may take its next decision at any time
        r = rng.choice(live)
        a = next(progs[r], None)
        if a is None:
            live.remove(r)
        else:
            actions[r].append(a)
    ran = sorted(i for acts in actions for a in acts for i in a[1])
    assert ran == list(range(len(lengths)))
    for r, acts in enumerate(actions):
        own = [i for a in acts if a[0] == "own" for i in a[1]]
        order = [i for mb in sp.lists[r] for i in mb]
        assert own == [i for i in order if i in own], "own samples in list order"
        mb_of = {i: k for k, mb in enumerate(sp.lists[r]) for i in mb}
        assert all(len({mb_of[i] for i in a[1]}) == 1 for a in acts if a[0] == "own")
        assert sum(a[0] == "stop" for a in acts) == 1
        plan = realised_plan(("a", "b"), r, acts)
        assert plan.microbatches == tuple(a[1] for a in acts if a[1])
        assert isinstance(plan.steps[-1], Sync)
        fwd = [s.mb for s in plan.steps if isinstance(s, Forward) and s.unit == "a"]
        assert fwd == list(range(len(plan.microbatches)))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(1, 40), min_size=1, max_size=20))
def test_ranks_in_lockstep_run_exactly_lb_mini(world, lengths):
    """Without pace rules and with a guard that never pays, nothing moves: each rank runs its
    LB-Mini list as planned (the simulator shows the pace rules stay quiet on equal devices)."""
    sp = steal_plan(lengths, world, 40, cost=TOK)
    fa = ArrayCounters(sp.num_counters)
    progs = [program(sp, fa, r, tolerance=None, overhead=lambda: float("inf")) for r in range(world)]
    ran: list[list] = [[] for _ in range(world)]
    live = list(range(world))
    while live:
        for r in list(live):
            a = next(progs[r], None)
            if a is None:
                live.remove(r)
            elif a[1]:
                ran[r].append(a[1])
    assert tuple(tuple(x) for x in ran) == lb_mini(lengths, world, 40, cost=TOK)


def test_split_cost_runs_expensive_microbatches_sample_by_sample():
    lengths = [4, 4, 4, 1, 1, 1]
    packed = steal_plan(lengths, 1, 12, cost=TOK)
    assert packed.lists == lb_mini(lengths, 1, 12, cost=TOK) == (((0, 1, 2), (3, 4, 5)),)
    split = steal_plan(lengths, 1, 12, cost=TOK, split_cost=4.0)
    assert split.lists == (((0,), (1,), (2,), (3, 4, 5)),)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(1, 40), min_size=1, max_size=20),
       st.sampled_from([0.0, 0.1, 0.3, 0.5, 1.0]))
def test_split_tail_runs_only_the_lists_tail_sample_by_sample(world, lengths, tail):
    """Each list keeps LB-Mini's samples in LB-Mini's order; a sample of a packed microbatch runs
    alone exactly when its list's cost up to and including it exceeds (1 - tail) of the list's
    total (the tail, where thieves take from); the others stay in their LB-Mini microbatch."""
    packed = lb_mini(lengths, world, 40, cost=TOK)
    sp = steal_plan(lengths, world, 40, cost=TOK, split_tail=tail)
    for mbs, own in zip(packed, sp.lists, strict=True):
        assert [s for mb in own for s in mb] == [s for mb in mbs for s in mb]
        total = sum(TOK(lengths[s]) for mb in mbs for s in mb)
        want, done = [], 0.0
        for mb in mbs:
            keep = []
            for s in mb:
                done += TOK(lengths[s])
                (want.append((s,)) if tail > 0 and done > (1 - tail) * total * (1 + 1e-12)
                 else keep.append(s))
            if keep:
                want.insert(len(want) - (len(mb) - len(keep)), tuple(keep))
        assert own == tuple(want)
    if tail == 0:
        assert sp.lists == packed
    if tail == 1:
        assert all(len(mb) == 1 for own in sp.lists for mb in own)


@pytest.mark.parametrize("n_units", [1, 2, 3, 4])
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
@pytest.mark.parametrize("reshard", [True, False])
def test_owner_steps_compose_to_the_static_plan(n_units, prefetch, reshard):
    """prefix + middle x (n-1) + last, renumbered, is compile_plan's plan of n microbatches."""
    units = tuple(f"u{i}" for i in range(n_units))
    for remat in (frozenset(), frozenset(units[:1])):
        opts = ScheduleOptions(prefetch=prefetch, reshard_after_forward=reshard, remat=remat)
        o = owner_steps(units, opts)
        for n in range(1, 5):
            acts = [Action("own", (k,), k < n - 1) for k in range(n)] + [Action("stop", (), False)]
            got = realised_plan(units, 0, acts, opts)
            want = compile_plan(units, (tuple((k,) for k in range(n)),), 0, "odc", opts)
            assert got == want
        held = {s.unit for s in o.held}
        assert held == {s.unit for s in o.prefix if isinstance(s, Gather)}
