"""``odcfn bench --only recovery``: what saving costs training, and what a crash costs.

1. **Blocked time per save**: W processes train the bench model; between steps each rank saves
   its state, alternately with the blocking ``odcfn.save`` and with ``blocking=False`` (the
   step then waits only for the host snapshot, and for the previous save if it is still in
   flight). Reported: the time ``save`` kept the training loop, per mode, and their ratio.
2. **Deterministic accumulation**: steps with ``StepConfig(deterministic=True)`` interleaved
   with default steps; the step-time ratio.
3. **Memory-tier overhead**: steps interleaved with and without a snapshot to the /dev/shm tier
   after every step (background write, rank 0 verifies and switches the pointer); the step time
   ratio includes the snapshot copy and the contention of the background writer.
4. **Recovery**: ``odcfn train`` (processes backend, ``max_restarts=1``) on a small model; one
   rank is SIGKILLed right after step ``kill_after`` is logged; measured from the kill to the
   next step logged, with a snapshot in the memory tier every step vs the disk tier only
   (every ``disk_every`` steps): lost steps and the breakdown (detect + tear down + spawn,
   start-up to resume, reading the snapshot, first step). Then the memory tier across two
   simulated nodes: the killed rank's node restarts without its memory and reads its files back
   from the other node (timed from the last step logged before the kill; the read is the fetch).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

__all__ = ["section"]


def _save_worker(model_cfg: Any, lengths: list[int], rounds: int, shm_root: str, where: str) -> dict:
    import torch

    import odcfn
    from odcfn.checkpoint.async_save import AsyncSaver
    from odcfn.checkpoint.memory_tier import MemoryTier
    from odcfn.models import init_params, qwen_model
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    model = qwen_model(model_cfg)
    batch = odcfn.random_batch(lengths, model_cfg.vocab_size, seed=0)
    root = Path(where)  # one directory for all ranks: the file system is the save's barrier
    os.environ["ODCFN_SHM_DIR"] = shm_root
    tier = MemoryTier(root)
    times: dict[str, list[float]] = {"step": [], "blocking": [], "async": [], "step+memory": []}
    try:
        with ShmTransport(mesh, timeout=120) as tr:
            state = odcfn.TrainState.create(params=init_params(model_cfg, seed=0), model=model,
                                            optimizer=odcfn.adamw(1e-3), transport=tr,
                                            config=odcfn.StepConfig(balance="lb_mini"))
            saver, mem = AsyncSaver(), AsyncSaver()
            state, _ = odcfn.train_step(state, batch)  # warm-up
            for i in range(rounds):
                # 1. blocked time: a step, then a save of each kind (async overlaps the next step)
                t0 = time.perf_counter()
                state, _ = odcfn.train_step(state, batch)
                t1 = time.perf_counter()
                odcfn.save(root / f"b{i}", state)
                t2 = time.perf_counter()
                state, _ = odcfn.train_step(state, batch)
                t3 = time.perf_counter()
                saver.save(root / f"a{i}", state.params, state.opt_state, state.step, model=model, mesh=mesh)
                t4 = time.perf_counter()
                times["step"] += [t1 - t0, t3 - t2]
                times["blocking"].append(t2 - t1)
                times["async"].append(t4 - t3)
            saver.wait()
            for _ in range(rounds):
                # 2. memory tier every step vs none, interleaved
                t0 = time.perf_counter()
                state, _ = odcfn.train_step(state, batch)
                t1 = time.perf_counter()
                state, _ = odcfn.train_step(state, batch)
                mem.save(tier.path(state.step), state.params, state.opt_state, state.step, model=model,
                         mesh=mesh, after=tier.publish if mesh.rank == 0 else None)
                t2 = time.perf_counter()
                times["step"].append(t1 - t0)
                times["step+memory"].append(t2 - t1)
            mem.wait()
            det = state.config.replace(deterministic=True)
            fast = state.config
            times["deterministic"] = []
            for _ in range(rounds):
                # 3. deterministic accumulation vs the default order, interleaved
                t0 = time.perf_counter()
                state, _ = odcfn.train_step(state.replace(config=fast), batch)
                t1 = time.perf_counter()
                state, _ = odcfn.train_step(state.replace(config=det), batch)
                t2 = time.perf_counter()
                times["step"].append(t1 - t0)
                times["deterministic"].append(t2 - t1)
            tr.collectives.barrier()
            nbytes = sum(f.stat().st_size for f in (root / "b0").glob("*.safetensors"))
    finally:
        if mesh.rank == 0:
            tier.cleanup()
    return {"times": times, "bytes": nbytes, "background_write_s": saver.written_s / max(1, rounds)}


_RESUME = re.compile(r"resuming at step (\d+) from (\S+) \(read in ([0-9.]+)s\)")


def _kids(pid: int) -> list[int]:
    try:
        kids = [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    out = []
    for k in kids:
        try:
            if "spawn_main" in Path(f"/proc/{k}/cmdline").read_text(errors="replace"):
                out.append(k)
        except OSError:
            continue  # listed, then gone
    return out


def _recovery_job(root: Path, steps: int, disk_every: int, memory: bool) -> dict:
    """The recovery runs' data (written under ``root``) and config."""
    from odcfn.data.records import synthetic_records, write_jsonl

    write_jsonl(root / "train.jsonl", synthetic_records([24, 40, 32, 56, 28, 48, 36, 20] * 2, 128, seed=0))
    return {
        "out_dir": str(root / "out"),
        "model": {"vocab_size": 128, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "d_ff": 192},
        "data": {"path": str(root / "train.jsonl"), "batch_size": 8},
        "train": {"steps": steps, "lr": 1e-3, "world_size": 2, "backend": "processes", "max_restarts": 1,
                  "deterministic": True},
        "checkpoint": {"every": disk_every, "memory_every": 1 if memory else 0},
        "log": {"progress": False},
    }


def _recovery_run(root: Path, memory: bool, steps: int, kill_after: int, disk_every: int) -> dict:
    doc = _recovery_job(root, steps, disk_every, memory)
    (root / "run.json").write_text(json.dumps(doc))
    metrics = root / "out" / "metrics.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "odcfn.cli", "train", "--config", str(root / "run.json"),
                             "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    t_kill, lines = None, 0
    while proc.poll() is None and t_kill is None:
        lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        ranks = _kids(proc.pid)
        if lines >= kill_after and len(ranks) == 2:
            try:
                os.kill(ranks[-1], signal.SIGKILL)
            except ProcessLookupError:
                continue  # gone between the listing and the kill: list again
            t_kill = time.time()
            old = set(ranks)
        time.sleep(0.002)
    t_spawn = None
    while proc.poll() is None and t_spawn is None:
        new = [k for k in _kids(proc.pid) if k not in old]
        if len(new) == 2:
            t_spawn = time.time()
        time.sleep(0.002)
    _, err = proc.communicate(timeout=600)
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    m = _RESUME.search(err)
    if proc.returncode != 0 or t_kill is None or m is None:
        raise RuntimeError(f"recovery run failed (rc {proc.returncode}): {err[-2000:]}")
    resumed, read_s = int(m.group(1)), float(m.group(3))
    logged = lines  # steps logged when the kill came
    first = next(r for r in recs if r["step"] == resumed + 1)  # the rerun's first step: its line
    # (metrics lines carry the wall time at which they were written)
    return {
        "tier": "memory" if memory else "disk",
        "killed_after_step": logged,
        "resumed_at_step": resumed,
        "lost_steps": logged - resumed,
        "kill_to_next_step_s": first["time"] - t_kill,
        # until the run is past where it was killed (the lost steps redone)
        "kill_to_progress_s": next(r for r in recs if r["step"] == logged + 1)["time"] - t_kill,
        "breakdown_s": {
            "detect_teardown_spawn": (t_spawn - t_kill) if t_spawn else None,
            "startup_to_resume": None,  # filled below: what remains after reading and the step
            "read_snapshot": read_s,
            "first_step": first["step_time"],
        },
    }


def _node_recovery_run(root: Path, steps: int, kill_after: int, disk_every: int) -> dict:
    """Two simulated nodes, the memory tier every step; rank 1 (node 1) kills itself at the
    start of step ``kill_after + 1`` and its node restarts with an empty snapshot directory, so
    its files come back from node 0's copy. Timed from the last step logged before the kill."""
    from odcfn.launch import launch
    from odcfn.sft.simulated_nodes import node_worker

    doc = _recovery_job(root, steps, disk_every, memory=True)
    env = {"ODCFN_TEST_KILL_AT": f"step:{kill_after + 1}:1", "OMP_NUM_THREADS": "1"}
    metrics, seen, stop = root / "out" / "metrics.jsonl", [], threading.Event()

    def watch() -> None:  # when the killed step's predecessor is first logged (a rerun rewrites it)
        while not stop.is_set() and not seen:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after:
                seen.append(time.time())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = launch(node_worker, 2, nodes=2, args=(doc, str(root / "snap"), (1,)), env=env, timeout=120,
                     max_restarts=1)
    finally:
        stop.set()
        watcher.join()
    recs = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines())}
    resumed, fetch = out[1]["start_step"], out[1]["snapshot_fetch"]
    if fetch is None or not seen:
        raise RuntimeError(f"node 1 restarted without its memory but read nothing back: {out}")
    t_kill = seen[0]  # rank 1 kills itself as the next step starts, right after this line
    return {
        "tier": "memory, 2 nodes, node lost",
        "killed_after_step": kill_after,
        "resumed_at_step": resumed,
        "lost_steps": kill_after - resumed,
        "kill_to_next_step_s": recs[resumed + 1]["time"] - t_kill,
        "kill_to_progress_s": recs[kill_after + 1]["time"] - t_kill,
        "fetch": {"bytes": fetch["bytes"], "seconds": fetch["seconds"], "from_nodes": fetch["from_nodes"]},
        "breakdown_s": {"detect_teardown_spawn": None, "startup_to_resume": None,
                        "read_snapshot": fetch["seconds"], "first_step": recs[resumed + 1]["step_time"]},
    }


def section(ctx: Any) -> dict:
    from odcfn.launch import launch

    w = ctx.workload
    rounds = max(2, ctx.steps)
    lengths = [256, 384, 512, 320, 448, 288, 352, 416][: 4 * w.world_size]
    shm_root = os.environ.get("ODCFN_SHM_DIR", "/dev/shm")
    ctx.log(f"   saves: {rounds} rounds per mode on the bench model, {w.world_size} processes")
    where = tempfile.mkdtemp(prefix="odcfn-bench-save-")
    try:
        args = (w.model, lengths, rounds, shm_root, where)
        out = launch(_save_worker, w.world_size, args=args, timeout=600)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    t = {k: [max(o["times"][k][i] for o in out) for i in range(len(out[0]["times"][k]))]
         for k in out[0]["times"]}  # per round: the slowest rank
    med = {k: statistics.median(v) for k, v in t.items()}
    res: dict[str, Any] = {
        "checkpoint_bytes_per_rank": out[0]["bytes"],
        "step_s": med["step"],
        "blocked_per_save_s": {"blocking": med["blocking"], "async": med["async"]},
        "async_over_blocking": med["async"] / med["blocking"] if med["blocking"] else None,
        "background_write_s": statistics.median(o["background_write_s"] for o in out),
        "memory_tier_every_step": {"step_s": med["step+memory"],
                                   "overhead": med["step+memory"] / med["step"] - 1.0},
        "deterministic_step_overhead": med["deterministic"] / med["step"] - 1.0,
        "definition": "medians over rounds of the slowest rank; blocked = time inside save(); "
                      "memory overhead = (step + snapshot call) / step - 1, interleaved",
    }
    rec = []
    for memory in (True, False):
        what = "memory tier every step" if memory else "disk only"
        ctx.log(f"   recovery: SIGKILL a rank of odcfn train, {what}")
        d = Path(tempfile.mkdtemp(prefix="odcfn-bench-rec-"))
        try:
            os.environ.setdefault("ODCFN_SHM_DIR", shm_root)
            r = _recovery_run(d, memory, steps=12, kill_after=7, disk_every=5)
            b = r["breakdown_s"]
            known = (b["detect_teardown_spawn"] or 0) + b["read_snapshot"] + b["first_step"]
            b["startup_to_resume"] = r["kill_to_next_step_s"] - known
            rec.append(r)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    ctx.log("   recovery: 2 simulated nodes, a rank killed and its node back without its memory")
    d = Path(tempfile.mkdtemp(prefix="odcfn-bench-rec-"))
    try:
        r = _node_recovery_run(d, steps=12, kill_after=7, disk_every=5)
        b = r["breakdown_s"]
        b["startup_to_resume"] = r["kill_to_next_step_s"] - b["read_snapshot"] - b["first_step"]
        rec.append(r)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    res["recovery"] = rec
    res["run_id"] = uuid.uuid4().hex[:6]
    return res
