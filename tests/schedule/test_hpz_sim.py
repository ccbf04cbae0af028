"""hpZ in the simulator: the backward's gathers from the k-rank group cost the group's
transfer (intra-node when the group is a node), the forward's still cross nodes."""

from __future__ import annotations

import pytest

from odcfn.schedule import ScheduleOptions, compile_plans, simulate
from odcfn.schedule.cost import TokenCost
from odcfn.schedule.simmodel import CommModel, Workload
from odcfn.sharding import Mesh

W, NODE = 8, 4
NET = CommModel(intra_bandwidth=100e9, inter_bandwidth=1e9)  # slow across nodes: comm-bound
# 8.75 s per cross-node gather, pushes nearly free: the gathers bound the step (hpZ leaves the
# pushes to their owners, across nodes, as ZeRO++ does)
WORK = Workload.uniform(4, model_bytes=4e10, grad_bytes=1e3)
ASSIGNMENT = tuple(((r,),) for r in range(W))


def _gathers(res, rank):
    return [e.end - e.start for e in res.events[rank] if e.kind == "gather"]


def test_group_gathers_cost_the_group_transfer_and_shorten_a_comm_bound_step():
    lengths = [8] * W
    mesh = Mesh(W, 0, NODE)

    def run(k: int | None):  # None: the default options (no hierarchical shards)
        opts = None if k is None else ScheduleOptions(reshard_after_forward=k)
        plans = compile_plans(WORK.units, ASSIGNMENT, "odc", opts)
        return simulate(plans, lengths, workload=WORK, cost=TokenCost(), comm=NET, mesh=mesh)

    base, hpz = run(None), run(NODE)
    unit = 1e10
    owners = unit * (W - 1) / W / NET.inter_bandwidth  # the hybrid rule: W spans nodes
    group = unit * (NODE - 1) / NODE / NET.intra_bandwidth
    assert _gathers(base, 0) == pytest.approx([owners] * 7)  # 4 forward + 3 backward
    assert sorted(_gathers(hpz, 0)) == pytest.approx([group] * 3 + [owners] * 4)
    assert hpz.makespan < base.makespan - 2.5 * owners
    # a group of 8 spans both nodes: inter-node bandwidth, as for a shard group that spans them
    wide = run(W)
    assert sorted(_gathers(wide, 0)) == pytest.approx([unit * 7 / 8 / NET.inter_bandwidth] * 7)


def test_bad_k_refused_by_the_compiler():
    with pytest.raises(ValueError, match="reshard_after_forward=3"):
        compile_plans(WORK.units, ASSIGNMENT, "odc", ScheduleOptions(reshard_after_forward=3))
    with pytest.raises(ValueError, match="reshard_after_forward=2.*comm='odc'"):
        compile_plans(WORK.units, ASSIGNMENT, "collective", ScheduleOptions(reshard_after_forward=2))
