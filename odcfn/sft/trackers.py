"""Where ``odcfn train``'s metrics go besides ``metrics.jsonl``: ``[log] backends`` names any of
TensorBoard, wandb, trackio and MLflow. Each is an optional extra (``pip install 'odcfn[NAME]'``);
one that is named but not installed is refused when the config is checked, naming the key and the
install command, never skipped in silence.

Every backend gets the same metric names as the JSONL line (every numeric key but ``step``, at
that step) and the run's config once, when the run starts (trackio replaces a run's config at
every init: a resumed run's is the config it continues with). A resumed run continues the same
backend run: the ids are kept in ``<out_dir>/trackers.json`` (wandb's run id, MLflow's run id and
tracking URI, trackio's project and run name); a fresh start (``--no-resume``, or no checkpoint)
opens new ones. Where each writes:

- tensorboard: ``<out_dir>/tensorboard`` (event files; the config as a text summary);
- wandb: offline unless ``WANDB_MODE`` says otherwise or ``WANDB_API_KEY`` is set (then online),
  run files under ``<out_dir>/wandb`` (``wandb sync`` uploads them later); project
  ``WANDB_PROJECT`` or "odcfn";
- trackio: its local store (``TRACKIO_DIR``, default ``$HF_HOME/trackio``), project
  ``TRACKIO_PROJECT`` or "odcfn";
- mlflow: ``MLFLOW_TRACKING_URI``, or ``sqlite:///<out_dir>/mlflow.db`` when unset (MLflow's
  file store is deprecated); experiment ``MLFLOW_EXPERIMENT_NAME`` or "odcfn"; the config as
  params ``section.key``.

The backends run on one background thread fed by a queue, written every ``FLUSH_SECONDS`` with
what arrived meanwhile, so a step pays only for the JSONL line and an enqueue;
``Trackers.seconds`` is the time spent on each side, the background's in CPU time
(``odcfn.sft.record`` reports it against the step time at the end of the run). A backend that
fails at run time is named once on stderr and dropped; the JSONL log goes on.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path
from typing import Any

__all__ = ["BACKENDS", "IDS_NAME", "Trackers", "check_installed", "wanted"]

BACKENDS = ("jsonl", "tensorboard", "wandb", "trackio", "mlflow")
IDS_NAME = "trackers.json"
FLUSH_SECONDS = 2.0  # the backends are written at most this often (close writes what is left)
# the modules each backend imports (all must be found), and its extra
_MODULES = {"tensorboard": ("tensorboard", "torch.utils.tensorboard"), "wandb": ("wandb",),
            "trackio": ("trackio",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}


def wanted(log: Any) -> list[str]:
    """The backends a ``[log]`` section asks for besides JSONL (``log.tensorboard = true`` is
    ``"tensorboard"`` in ``log.backends``), in order, once each."""
    names = [b for b in log.backends if b != "jsonl"] + (["tensorboard"] if log.tensorboard else [])
    return list(dict.fromkeys(names))


def check_installed(log: Any) -> None:
    """Each backend asked for can be imported: else a ValueError naming ``log.backends`` and how to
    install it (found without importing: wandb and mlflow take seconds to import)."""
    for name in wanted(log):
        for module in _MODULES[name]:
            if not _found(module):
                key = "log.tensorboard" if name == "tensorboard" and "tensorboard" not in log.backends else \
                    "log.backends"
                raise ValueError(f"config: {key} asks for {name}, but {module} is not installed: "
                                 f"pip install 'odcfn[{name}]'")


def _found(module: str) -> bool:
    if module in sys.modules:  # imported already (or blocked: None)
        return sys.modules[module] is not None
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def _flat(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if isinstance(v, dict) and k != "staleness":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _TensorBoard:
    def __init__(self, out: Path, ids: dict[str, Any], config: dict[str, Any], fresh: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(out / "tensorboard"))
        if fresh:
            self.w.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, lines: list[tuple[int, dict[str, float]]]) -> None:
        for step, metrics in lines:
            for k, v in metrics.items():
                self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class _Wandb:
    def __init__(self, out: Path, ids: dict[str, Any], config: dict[str, Any], fresh: bool) -> None:
        import wandb

        mine = ids.setdefault("wandb", {})
        if fresh or "id" not in mine:
            mine["id"] = uuid.uuid4().hex[:12]  # wandb: [a-z0-9], unique per project
        # no network configured: offline, the run's files under out_dir for a later `wandb sync`
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        mine["mode"] = mode
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "odcfn"), id=mine["id"], resume="allow",
                              dir=str(out), mode=mode, config=config if fresh else None,
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))

    def log(self, lines: list[tuple[int, dict[str, float]]]) -> None:
        for step, metrics in lines:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    def __init__(self, out: Path, ids: dict[str, Any], config: dict[str, Any], fresh: bool) -> None:
        import trackio

        mine = ids.setdefault("trackio", {})
        if fresh or "name" not in mine:
            mine.update(project=os.environ.get("TRACKIO_PROJECT", "odcfn"),
                        name=f"{out.name}-{uuid.uuid4().hex[:8]}")
        # trackio keeps one config per run and each init replaces it (None included): a resumed
        # run gives the config it continues with
        self.run = trackio.init(project=mine["project"], name=mine["name"], resume="allow",
                                config=config, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, lines: list[tuple[int, dict[str, float]]]) -> None:
        for step, metrics in lines:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, out: Path, ids: dict[str, Any], config: dict[str, Any], fresh: bool) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        mine = ids.setdefault("mlflow", {})
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        if fresh or mine.get("tracking_uri") != uri or "run_id" not in mine:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "odcfn")
            exp = self.client.get_experiment_by_name(name)
            eid = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            mine.update(tracking_uri=uri, run_id=self.client.create_run(eid, run_name=out.name).info.run_id)
            params = [Param(k, json.dumps(v)[:6000]) for k, v in _flat(config).items()]
            for at in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(mine["run_id"], params=params[at:at + 100])
        else:  # resumed: the same run, running again
            self.client.update_run(mine["run_id"], status="RUNNING")
        self.run_id = mine["run_id"]

    def log(self, lines: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for step, metrics in lines for k, v in metrics.items()]
        for at in range(0, len(batch), 1000):  # one transaction per 1000 values (MLflow's batch limit)
            self.client.log_batch(self.run_id, metrics=batch[at:at + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_OPEN = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio, "mlflow": _Mlflow}


class Trackers:
    """Rank 0's backends for one run: opened at the start (``start``: the step the run resumes
    from, 0 for a fresh one), fed from the training thread, written by a background thread."""

    def __init__(self, cfg: Any, start: int) -> None:
        check_installed(cfg.log)  # a config built without load_config: the same refusal
        self.names = wanted(cfg.log)
        # the training thread's enqueues, the background's per-line work, opening and closing
        self.seconds = {"caller": 0.0, "backends": 0.0, "open": 0.0, "close": 0.0}
        self.backends: dict[str, Any] = {}
        self.queue: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        if not self.names:
            return
        out = Path(cfg.out_dir)
        path = out / IDS_NAME
        ids: dict[str, Any] = {}
        if start > 0 and path.is_file():
            try:
                ids = json.loads(path.read_text())
            except ValueError:
                print(f"odcfn train: {path} is unreadable; the backends start new runs", file=sys.stderr)
        config = asdict(cfg)
        t0 = time.perf_counter()
        for name in self.names:
            self.backends[name] = _OPEN[name](out, ids, config, fresh=start == 0 or not ids.get(name))
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(ids, indent=1) + "\n")
        os.replace(tmp, path)
        self.seconds["open"] = time.perf_counter() - t0
        self.thread = threading.Thread(target=self._work, name="odcfn-trackers", daemon=True)
        self.thread.start()

    def log(self, rec: dict[str, Any]) -> None:
        """Hand one metrics line to the backends (every numeric key but ``step``)."""
        if self.thread is None:
            return
        t0 = time.perf_counter()
        metrics = {k: v for k, v in rec.items() if k != "step" and isinstance(v, (int, float))}
        self.queue.put((rec["step"], metrics))
        self.seconds["caller"] += time.perf_counter() - t0

    def _work(self) -> None:
        done = False
        while not done:
            # what arrives within FLUSH_SECONDS goes out together: a dashboard needs no faster
            # updates, and a store's cost is per write (MLflow: one sqlite transaction per batch)
            lines = [self.queue.get()]
            deadline = time.monotonic() + FLUSH_SECONDS
            while lines[-1] is not None and deadline > time.monotonic():
                try:
                    lines.append(self.queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            done = lines[-1] is None
            self._write([x for x in lines if x is not None])

    def _write(self, lines: list[tuple[int, dict[str, float]]]) -> None:
        if not lines:
            return
        # CPU time, not wall time: waiting for the GIL or a core is the training's time, not ours
        t0 = time.thread_time()
        for name, b in list(self.backends.items()):
            t1 = time.thread_time()
            try:
                b.log(lines)
                self.seconds[name] = self.seconds.get(name, 0.0) + time.thread_time() - t1
            except Exception as e:  # a dashboard's failure must not end the training
                print(f"odcfn train: log backend {name} failed ({type(e).__name__}: {e}); "
                      "dropping it (metrics.jsonl goes on)", file=sys.stderr, flush=True)
                del self.backends[name]
        self.seconds["backends"] += time.thread_time() - t0

    def close(self) -> None:
        """Write what is queued and close every backend."""
        if self.thread is None:
            return
        self.queue.put(None)
        self.thread.join()
        self.thread = None
        t0 = time.perf_counter()
        for b in self.backends.values():
            b.close()
        self.seconds["close"] = time.perf_counter() - t0
