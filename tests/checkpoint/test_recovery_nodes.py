"""The memory tier across nodes (odcfn/checkpoint/node_tier.py), between processes on this machine.

Two simulated nodes of one rank each, each with its own snapshot directory (``ODCFN_SNAPSHOT_DIR``
per node: one node never sees the other's files, as with /dev/shm on two machines). A rank is
killed mid-run and, in the restarted job, its node comes back *without its memory* (its snapshot
directory is gone, as after a reboot or on a replacement machine). The job must resume from the
memory tier anyway, its files read back from the neighbour's copy, not from the older disk
checkpoint, and finish with the uninterrupted run's parameters bit for bit. The job and its
restart run on the test pool's warm workers (``TORCHELASTIC_RESTART_COUNT`` set as a launcher
sets it), so that only the killed rank's worker is a fresh process.

The wire itself (``neighbour.Inbox``) is tested against hostile senders: a header sealed with
another secret, a payload that does not match its header's sha256, a truncated message, a name
outside the snapshot's files. Each is refused and leaves no file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from odcfn.checkpoint.commit import CheckpointError
from odcfn.checkpoint.memory_tier import committed, verify_all
from odcfn.checkpoint.neighbour import Inbox, recv_dir, send_files
from odcfn.data.records import synthetic_records, write_jsonl
from odcfn.launch import LaunchError, launch
from odcfn.sft.simulated_nodes import node_worker
from odcfn.transport.rdzv import seal
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture

STEPS = 9
LENGTHS = [5, 9, 7, 12, 6, 8, 10, 4, 11, 5, 7, 9, 13, 6, 8, 10, 5, 12]
SECRET = hashlib.sha256(b"odcfn tests: two simulated nodes").hexdigest()  # alike in every process


def _doc(root: Path) -> dict:
    return {
        "out_dir": str(root / "out"),
        "model": {"vocab_size": 40, "d_model": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 24},
        "data": {"path": str(root / "train.jsonl"), "batch_size": 12},
        "train": {
            "steps": STEPS,
            "lr": 1e-2,
            "world_size": 2,
            "backend": "processes",
            "max_grad_norm": 1.0,
            "max_tokens_per_microbatch": 20,
            "deterministic": True,
            "timeout": 30.0,
        },
        "checkpoint": {"every": 4, "keep": 2, "memory_every": 1},
        "log": {"progress": False},
    }


def _final(root: Path) -> list[dict[str, torch.Tensor]]:
    final = root / "out" / "checkpoints" / f"step-{STEPS:08d}"
    return [load_file(final / f"rank-{r:05d}.safetensors") for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, mp_pool):  # noqa: F811
    """The uninterrupted run's final shards (once per module, on the pool's warm workers)."""
    ref = tmp_path_factory.mktemp("reference")
    write_jsonl(ref / "train.jsonl", synthetic_records(LENGTHS, 40, seed=0))
    mp_pool.run(node_worker, 2, args=(_doc(ref), str(ref / "snap"), (), SECRET), timeout=300)
    return _final(ref)


# (kill, nodes back without their memory, the node that reads its files back or None: disk).
# Rank 0 (all of node 0) dies at the start of step 7: the memory tier holds step 6 (or 5, if the
# snapshot of 6 was in flight), the disk tier step 4. Rank 1 dies in its node's commit of the
# part of step 6 (its manifest written, the rename next): node 0 may have committed its part of 6
# (which holds rank 1's file too), so the job resumes at 6 or 5, node 1's file from node 0.
CASES = {
    "node0": ("step:7:0", (0,), 0),
    "node1-in-commit": ("commit:6:1", (1,), 1),
    "both": ("step:7:0", (0, 1), None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_node_that_lost_its_memory_resumes_from_its_neighbours_copy(
    tmp_path, shm, reference, mp_pool, case  # noqa: F811
):
    kill, lose, reader = CASES[case]
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "train.jsonl", synthetic_records(LENGTHS, 40, seed=0))
    snaps = tmp_path / "run-snap"
    args = (_doc(run), str(snaps), lose, SECRET)
    env = {"ODCFN_TEST_KILL_AT": kill, "ODCFN_SHM_DIR": str(shm)}
    # the job, then its restart, as a launcher with one restart runs them (the restart count in
    # the environment; the memory tier is keyed by the output directory, not by the processes),
    # on the pool's warm workers: only the killed rank's worker is a fresh process
    first: dict[int, str] = {}
    with pytest.raises(LaunchError) as info:
        mp_pool.run(node_worker, 2, args=args, env={**env, "TORCHELASTIC_RESTART_COUNT": "0"}, timeout=120,
                    output=first)
    victim = int(kill.split(":")[2])
    assert "died" in info.value.errors[victim], info.value.errors
    second: dict[int, str] = {}
    out = mp_pool.run(node_worker, 2, args=args, env={**env, "TORCHELASTIC_RESTART_COUNT": "1"}, timeout=300,
                      output=second)
    err = "".join(first.values()) + "".join(second.values())  # the killed rank's output is lost
    resumed = re.findall(r"resuming at step (\d+) from (\S+)", err)
    assert len(resumed) == 1, err[-3000:]
    step, path = int(resumed[0][0]), resumed[0][1]
    assert (out[0]["start_step"], out[0]["resumed_from"]) == (step, path)  # rank 0 says where
    fetched = [o["snapshot_fetch"] for o in out]
    if reader is not None:  # from the memory tier, the lost node's file read back from the other's copy
        assert step in (5, 6) and path.startswith(str(snaps / "node0")), resumed
        other = 1 - reader
        want = f"node {reader} read the files of ranks [{reader}] back from node(s) [{other}]"
        assert f"snapshot of step {step}: {want}" in err, err[-3000:]
        assert fetched[other] is None, fetched  # the node that kept its memory needed nothing
    else:  # two adjacent nodes lost: the disk tier's step 4
        assert step == 4 and path == str(run / "out" / "checkpoints" / "step-00000004"), resumed
        assert fetched == [None, None], fetched

    steps = [json.loads(x)["step"] for x in (run / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # nothing lost, nothing doubled
    for a, b in zip(_final(run), reference):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for node in (0, 1):  # the run's normal end removes each node's tier; nothing else is left
        assert not any((snaps / f"node{node}").iterdir()), list((snaps / f"node{node}").iterdir())
    assert not any(shm.iterdir()), sorted(p.name for p in shm.iterdir())


def test_snapshot_parts_hold_own_and_neighbour_files_and_a_corrupt_one_is_read_back(tmp_path, shm, mp_pool):  # noqa: F811
    """A 2-node run killed after step 2 or 3 (no cleanup) leaves in each node's tier parts
    holding that node's file and its neighbour's copy, byte-identical across nodes, which
    ``verify_all`` accepts only as a part. One bit flipped in node 0's own file of the newest
    part both nodes have: the rerun warns naming the file, reads it back from node 1 and
    finishes."""
    write_jsonl(tmp_path / "train.jsonl", synthetic_records(LENGTHS, 40, seed=0))
    doc = _doc(tmp_path)
    doc["train"]["steps"], doc["checkpoint"]["every"] = 4, 0
    snaps = tmp_path / "snap"
    env = {"ODCFN_TEST_KILL_AT": "step:4:0,step:4:1", "ODCFN_SHM_DIR": str(shm), "OMP_NUM_THREADS": "1"}
    with pytest.raises(LaunchError):
        launch(node_worker, 2, nodes=2, args=(doc, str(snaps), (), SECRET), env=env, timeout=30, deadline=300)
    roots = [next((snaps / f"node{n}").glob("odcfn-snap-*")) for n in (0, 1)]
    steps = [{s for s, _ in committed(root)} for root in roots]
    both = max(steps[0] & steps[1])
    assert both in (2, 3), steps
    for node, root in enumerate(roots):
        part = root / f"step-{both:08d}"
        verify_all(part, part_ok=True)
        with pytest.raises(CheckpointError, match="one node's part"):
            verify_all(part)
        m = json.loads((part / "manifest.json").read_text())
        assert m["part"] == {"node": node, "nodes": 2, "held": [0, 1]}
    for r in (0, 1):
        name = f"step-{both:08d}/rank-{r:05d}.safetensors"
        assert (roots[0] / name).read_bytes() == (roots[1] / name).read_bytes()

    for root in roots:  # the newest step both nodes have is the one to resume from
        for s_, d in committed(root):
            if s_ > both:
                shutil.rmtree(d)
    bad = roots[0] / f"step-{both:08d}" / "rank-00000.safetensors"
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 1
    bad.write_bytes(bytes(raw))
    env.pop("ODCFN_TEST_KILL_AT")
    output: dict[int, str] = {}  # the rerun on the pool's warm workers
    mp_pool.run(node_worker, 2, args=(doc, str(snaps), (), SECRET), env=env, timeout=300, output=output)
    err = "".join(output.values())
    assert f"snapshot file {bad} is missing or fails its sha256" in err, err[-3000:]
    assert f"snapshot of step {both}: node 0 read the files of ranks [0] back from node(s) [1]" in err, err[
        -3000:
    ]
    assert f"resuming at step {both} " in err, err[-3000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def tier_worker(phase: str, out: str, snaps: str, sharding: str) -> dict:
    """One rank of 2 simulated nodes of 2 ranks. ``save``: a train step, then a snapshot of
    the node tier (every rank's share, the leaders' push and commit); ``restore``: the tier's
    resume, then this rank's shards read from the checkpoint it names."""
    import odcfn
    from odcfn.checkpoint.async_save import AsyncSaver
    from odcfn.checkpoint.node_tier import NodeTier
    from odcfn.checkpoint.sharded import read_shards
    from odcfn.models import QwenConfig, init_params, qwen_model
    from odcfn.transport.shm import ShmTransport

    rank = int(os.environ["RANK"])
    os.environ.update(
        {
            "LOCAL_WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank % 2),
            "GROUP_RANK": str(rank // 2),
            "ODCFN_JOB_SECRET": SECRET,
            "ODCFN_SNAPSHOT_DIR": f"{snaps}/node{rank // 2}",
        }
    )
    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
    mesh = odcfn.Mesh.from_env(sharding)
    with ShmTransport(mesh, timeout=30) as tr:
        tier = NodeTier(out, mesh, tr.collectives, timeout=30)
        try:
            if phase == "save":
                state = odcfn.TrainState.create(
                    params=init_params(cfg, seed=0),
                    model=qwen_model(cfg),
                    optimizer=odcfn.adamw(1e-2),
                    transport=tr,
                    step=5,
                )
                state, _ = odcfn.train_step(state, odcfn.random_batch([5, 7, 9, 6], 37, seed=1))
                saver = AsyncSaver()
                saver.save(
                    tier.path(state.step),
                    state.params,
                    state.opt_state,
                    state.step,
                    model=state.model,
                    mesh=mesh,
                    writer=tier.write,
                    after=tier.publish if tier.leader else None,
                )
                saver.wait()
                params, moments, step = state.params, state.opt_state["mu"], state.step
            else:
                ck = tier.resume(Path(out) / "disk")
                params, opt, step = read_shards(ck, model=qwen_model(cfg), mesh=mesh)
                moments = opt["mu"]
            return {
                "params": {k: v.numpy().copy() for k, v in params.items()},
                "mu": {k: v.numpy().copy() for k, v in moments.items()},
                "step": step,
                "fetched": tier.fetched,
            }
        finally:
            tier.close()


@pytest.mark.parametrize("sharding", ["full", "hybrid"])
def test_nodes_of_two_ranks_restore_every_shard_after_node0_lost_its_memory(tmp_path, mp_pool, sharding):  # noqa: F811
    """Two ranks per node: the non-leader ranks write and wait for their leader's commit; under
    hybrid sharding only node 0's ranks write (node 1 keeps their copy). Node 0's tier is then
    deleted; on resume node 0 reads ranks 0 and 1's files back from node 1 (node 1 needs nothing
    under either sharding), and every rank's params and moments equal what it saved."""
    out, snaps = str(tmp_path / "out"), str(tmp_path / "snap")
    saved = mp_pool.run(tier_worker, 4, args=("save", out, snaps, sharding), timeout=120)
    shutil.rmtree(tmp_path / "snap" / "node0")
    back = mp_pool.run(tier_worker, 4, args=("restore", out, snaps, sharding), timeout=120)
    for a, b in zip(saved, back):
        assert a["step"] == b["step"] == 6
        for k in ("params", "mu"):
            assert a[k].keys() == b[k].keys() and all((a[k][u] == b[k][u]).all() for u in a[k])
    assert back[0]["fetched"]["ranks"] == [0, 1] and back[0]["fetched"]["from_nodes"] == [1]
    assert [b["fetched"] for b in back[1:]] == [None, None, None]


# --- the wire against hostile senders ------------------------------------------------------------


@pytest.fixture
def inbox(tmp_path):
    box = Inbox(tmp_path / "tier", bytes.fromhex(SECRET), "run", 1, "127.0.0.1")
    yield box
    box.close()


def _payload(tmp_path: Path, data: bytes = b"x" * 1000) -> Path:
    f = tmp_path / "payload"
    f.write_bytes(data)
    return f


def _raw(address, frames: list[bytes]) -> None:
    with socket.create_connection(address, timeout=5) as c:
        for f in frames:
            c.sendall(f)


def _frame(secret: str, header: dict, payload: bytes) -> bytes:
    head = seal(bytes.fromhex(secret), "odcfn-snapshot/run", header)
    return struct.pack(">Q", len(head)) + head + payload


def test_the_inbox_takes_an_authentic_file(tmp_path, inbox):
    f = _payload(tmp_path)
    send_files(
        inbox.address,
        [("rank-00000.safetensors", f)],
        step=3,
        to=1,
        run="run",
        secret=bytes.fromhex(SECRET),
        timeout=5,
    )
    got = inbox.wait(3, ["rank-00000.safetensors"], 5, "node 0")
    assert got["rank-00000.safetensors"]["bytes"] == 1000
    assert (recv_dir(inbox.root, 3) / "rank-00000.safetensors").read_bytes() == f.read_bytes()


@pytest.mark.parametrize("how", ["secret", "sha", "truncated", "name", "addressee"])
def test_the_inbox_refuses_what_it_cannot_trust_and_keeps_nothing(tmp_path, inbox, how):
    data = b"y" * 1000
    header = {
        "to": 1,
        "name": "rank-00000.safetensors",
        "step": 3,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    secret = SECRET
    if how == "secret":
        secret = secrets.token_hex(32)
    elif how == "sha":
        header["sha256"] = hashlib.sha256(b"z" * 1000).hexdigest()
    elif how == "name":
        header["name"] = "../../escape.safetensors"
    elif how == "addressee":
        header["to"] = 0
    frame = _frame(secret, header, data)
    _raw(inbox.address, [frame[:-10] if how == "truncated" else frame])
    with pytest.raises(TimeoutError, match="refused") as e:
        inbox.wait(3, ["rank-00000.safetensors"], 1.0, "node 0")
    assert "node 0" in str(e.value)
    left = list(recv_dir(inbox.root, 3).iterdir()) if recv_dir(inbox.root, 3).exists() else []
    assert left == [] and not (tmp_path / "escape.safetensors").exists()


def test_a_send_to_nobody_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    with pytest.raises(CheckpointError, match="node 1 at 127.0.0.1"):
        send_files(
            ("127.0.0.1", port),
            [("rank-00000.safetensors", _payload(tmp_path))],
            step=1,
            to=1,
            run="run",
            secret=bytes.fromhex(SECRET),
            timeout=2,
        )


def test_several_nodes_need_a_shared_secret(monkeypatch):
    import odcfn
    from odcfn.checkpoint.node_tier import NodeTier

    monkeypatch.delenv("ODCFN_JOB_SECRET", raising=False)
    with pytest.raises(ValueError, match="ODCFN_JOB_SECRET"):
        NodeTier("/tmp/out", odcfn.Mesh(4, 0, ranks_per_node=2), None)
