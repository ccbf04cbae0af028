"""Hostile launches: a stopped rank, a job past its deadline, env= overriding the torchrun
variables, two jobs forced onto one MASTER_PORT, meshes that disagree with the launcher, and the
simulated nodes of ``launch(nodes=N)``."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

import odcfn
from odcfn import LaunchError, launch
from odcfn.launch import check_job_store, free_port, host_store, rank_env
from odcfn.transport.base import TransportError


def stopped_rank_worker(path: str):
    """Rank 2 stops itself (SIGSTOP: alive, never answers); rank 1 gives up on it with a
    TransportError; rank 0 catches its own and returns normally."""
    rank = int(os.environ["RANK"])
    open(os.path.join(path, f"ready-{rank}"), "w").close()  # start together: imports take seconds
    deadline = time.monotonic() + 60
    while len(os.listdir(path)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 1:
        raise TransportError("timed out after 0.1s waiting for rank 2 (dead or stuck peer?)")
    return "returned"


def test_a_stopped_rank_fails_the_job_and_is_named_first(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        # the grace is generous so that ranks 0 and 1, which end at once, both end within it even
        # on a loaded machine (at 1 s, rank 0 was once still exiting when the grace ran out)
        launch(stopped_rank_worker, 3, args=(str(tmp_path),), timeout=5.0)
    took = time.monotonic() - t0
    err = info.value
    assert str(err).startswith("rank 2 failed: unresponsive: still running 5.0s after rank(s) [0, 1] ended")
    assert err.results == {0: "returned"} and set(err.errors) == {1, 2}
    # spawning 3 interpreters + 5 s grace (~10 s quiet, 40 s on a loaded 2-core machine); it used
    # to never return: the bound only separates "ends" from "hangs"
    assert took < 150, took


def sleeper(seconds: float):
    time.sleep(seconds)
    return "woke"


def test_the_job_deadline_bounds_a_job_where_nobody_fails():
    with pytest.raises(
        LaunchError, match="rank 0 failed: unresponsive: still running at the job's deadline of 3"
    ):
        launch(sleeper, 1, args=(600,), deadline=3)
    with pytest.raises(ValueError, match="deadline"):
        launch(sleeper, 1, args=(0,), deadline=0)


def test_env_may_not_override_the_torchrun_variables():
    for key in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK", "ODCFN_JOB_SECRET", "TORCHELASTIC_RUN_ID"):
        with pytest.raises(ValueError, match=f"may not override .*{key}"):
            launch(sleeper, 2, args=(0,), env={key: "1"})
    with pytest.raises(ValueError, match="not a multiple of nodes=3"):
        launch(sleeper, 4, nodes=3)


def port_worker(flag: str):
    """Publish this job's port, then wait until the test lets it finish."""
    with open(flag + ".port", "w") as f:
        f.write(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + 60
    while not os.path.exists(flag + ".go") and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.environ["ODCFN_JOB_ID"]


def test_a_second_job_on_the_same_port_is_refused_and_the_first_is_untouched(tmp_path, monkeypatch):
    flag = str(tmp_path / "a")
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(a=launch(port_worker, 1, args=(flag,), timeout=30)))
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag + ".port") and time.monotonic() < deadline:
            time.sleep(0.01)
        port = int(open(flag + ".port").read())
        monkeypatch.setattr(
            sys.modules["odcfn.launch.launcher"], "free_port", lambda: port
        )  # force job B onto A's port
        t0 = time.monotonic()
        with pytest.raises(
            RuntimeError, match=f"MASTER_PORT {port} is already in use .* no rank was started"
        ):
            launch(port_worker, 2, args=(str(tmp_path / "b"),))
        assert time.monotonic() - t0 < 10
        assert not os.path.exists(str(tmp_path / "b") + ".port")
    finally:
        open(flag + ".go", "w").close()
        t.join(60)
    assert len(out["a"]) == 1  # job A finished normally


def test_a_rank_refuses_a_store_with_another_job_id():
    port = free_port()
    store = host_store(port, "job-a", 5)
    check_job_store("127.0.0.1", port, "job-a")
    with pytest.raises(RuntimeError, match="belongs to job 'job-a', not to this rank's job 'job-b'"):
        check_job_store("127.0.0.1", port, "job-b", timeout=5)
    del store


def node_worker():
    mesh = odcfn.Mesh.from_env("hybrid")
    e = os.environ
    return {
        "env": {k: e[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")},
        "mesh": (mesh.node, mesh.local_rank, mesh.shard_group, mesh.replica_group),
        "secret": e["ODCFN_JOB_SECRET"],
        "prefix": e["ODCFN_SHM_PREFIX"],
    }


def test_launch_simulates_nodes_for_a_hybrid_mesh():
    out = launch(node_worker, 2, nodes=2, timeout=60)  # 2 nodes x 1 rank: cheap, still hybrid
    for r, o in enumerate(out):
        assert o["env"] == {"RANK": str(r), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(r)}
        assert o["mesh"] == (r, 0, (r,), (0, 1))
    # one fresh secret per job, shared by its ranks
    assert len({o["secret"] for o in out}) == 1 and len(out[0]["secret"]) == 64
    assert rank_env(5, 8, 1, "p", nodes=2)["LOCAL_RANK"] == "1"  # 2 nodes x 4: rank 5 = node 1, local 1
    assert rank_env(5, 8, 1, "p", nodes=2)["GROUP_RANK"] == "1"


# --- Mesh against the launcher's environment (no process needed) ------------------------------


@pytest.mark.parametrize(
    "args, match",
    [
        ((True,), "world_size must be an int, got bool"),
        ((2.0,), "world_size must be an int, got float"),
        ((2, 1.0), "rank must be an int, got float"),
        ((2, False), "rank must be an int, got bool"),
        ((4, 0, 2.0), "ranks_per_node must be an int, got float"),
    ],
)
def test_mesh_rejects_bool_and_float(args, match):
    with pytest.raises(TypeError, match=match):
        odcfn.Mesh(*args)


def test_a_mesh_the_launcher_did_not_start_fails_before_any_rendezvous(monkeypatch):
    from odcfn.transport.shm import ShmTransport

    port = free_port()  # nothing listens here: a rendezvous would wait for the store timeout
    for k, v in {
        "WORLD_SIZE": "2",
        "RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="WORLD_SIZE=2, the mesh has world_size=3"):
        ShmTransport(odcfn.Mesh(3, 0), timeout=30)
    with pytest.raises(ValueError, match="RANK=0, the mesh has rank=1"):
        ShmTransport(odcfn.Mesh(2, 1), timeout=30)
    assert time.monotonic() - t0 < 5


def test_mesh_from_env_reads_ray_and_checks_local_rank(monkeypatch):
    for k in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "RAY_LOCAL_WORLD_SIZE", "RAY_LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert odcfn.Mesh.from_env().ranks_per_node is None
    monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RAY_LOCAL_RANK", "1")
    m = odcfn.Mesh.from_env("hybrid")
    assert (m.ranks_per_node, m.node, m.local_rank) == (2, 1, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's wins when both are set
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert odcfn.Mesh.from_env().ranks_per_node == 4
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="LOCAL_RANK=0 but RANK=3 .* local rank 3"):
        odcfn.Mesh.from_env()
    monkeypatch.setenv("RANK", "three")
    with pytest.raises(ValueError, match="RANK='three' is not an integer"):
        odcfn.Mesh.from_env()
