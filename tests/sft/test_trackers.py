"""``[log] backends``: a real ``odcfn train`` run (2 steps, then resumed to 4) into TensorBoard,
wandb (offline), trackio (its local store) and MLflow (sqlite), each read back with the backend's
own reader (TensorBoard's ``EventAccumulator``, ``wandb leet inspect --json`` on the offline run
files, trackio's ``SQLiteStorage``, MLflow's ``MlflowClient``): the same metric names and values
as metrics.jsonl, the config once, the resumed run continuing the same backend run; logging's cost
on the training thread reported; a backend not installed is refused (issue 39)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from odcfn import cli
from tests.sft.test_sft import _setup

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = '[log]\nbackends = ["jsonl", "tensorboard", "wandb", "trackio", "mlflow"]\n'


def _train(cfg: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "odcfn.cli", "train", "--config", str(cfg), "--quiet", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _wandb_history(out: Path, run_id: str) -> tuple[dict[int, dict], list[dict]]:
    """Every step's history row and every run record, across the run's offline files."""
    rows, runs = {}, []
    for f in sorted(out.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        cmd = [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(f)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        for line in proc.stdout.splitlines():
            r = json.loads(line)
            if r["type"] == "history":
                rows[r["history"]["step"]["num"]] = r["history"]["item"]
            elif r["type"] == "run":
                runs.append(r["run"])
    return rows, runs


def test_every_backend_logs_what_the_jsonl_log_has_and_resume_continues_the_run(tmp_path):
    cfg = _setup(tmp_path, steps=2, every=2, extra=BACKENDS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TRACKIO_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TRACKIO_DIR=str(tmp_path / "trackio"),
               HF_HUB_OFFLINE="1", WANDB_PROJECT="odcfn-test")
    _train(cfg, env)
    out = tmp_path / "out"
    ids = json.loads((out / "trackers.json").read_text())
    proc = _train(cfg, env, "--steps", "4")  # resumes at step 2: the same runs continue
    assert json.loads((out / "trackers.json").read_text()) == ids
    jsonl = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [1, 2, 3, 4]
    names = {k for r in jsonl for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    loss = {r["step"]: r["loss"] for r in jsonl}

    # TensorBoard: both runs' event files under one directory
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == names
    tb = {e.step: e.value for e in acc.Scalars("loss")}
    assert tb == pytest.approx(loss, rel=1e-6)  # TensorBoard stores float32

    # wandb: offline (no key, no WANDB_MODE), files under out_dir, one run id for both processes
    assert ids["wandb"]["mode"] == "offline"
    rows, runs = _wandb_history(out, ids["wandb"]["id"])
    assert {s: r["loss"] for s, r in rows.items()} == loss
    assert names <= set(rows[4])
    assert len(runs) == 2 and {r["run_id"] for r in runs} == {ids["wandb"]["id"]}
    configs = [r["config"]["update"] for r in runs if "train" in r.get("config", {}).get("update", {})]
    assert len(configs) == 1 and configs[0]["train"]["steps"] == 2

    # trackio: its local store, read with its own storage class (TRACKIO_DIR is read at import)
    read = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
            "p, n = sys.argv[1:]; print(json.dumps([S.get_logs(p, n), S.get_run_config(p, n)]))")
    got = subprocess.run([sys.executable, "-c", read, ids["trackio"]["project"], ids["trackio"]["name"]],
                         capture_output=True, text=True, timeout=120, env=env, check=True)
    logs, config = json.loads(got.stdout.splitlines()[-1])
    assert {r["step"]: r["loss"] for r in logs} == loss
    assert config["train"]["steps"] == 4  # trackio's one config per run: the resumed run's

    # MLflow: the sqlite store under out_dir (MLFLOW_TRACKING_URI unset), one run across the resume
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=ids["mlflow"]["tracking_uri"])
    assert ids["mlflow"]["tracking_uri"] == f"sqlite:///{out.resolve() / 'mlflow.db'}"
    assert {m.step: m.value for m in client.get_metric_history(ids["mlflow"]["run_id"], "loss")} == loss
    run = client.get_run(ids["mlflow"]["run_id"])
    assert set(run.data.metrics) == names and run.data.params["train.steps"] == "2"
    assert run.info.status == "FINISHED"

    # logging's cost on the training thread, against the steps' own time
    m = re.search(r"logging \(jsonl, tensorboard, wandb, trackio, mlflow\): ([\d.]+) ms per step on the "
                  r"training thread \(([\d.]+)% of step time\)", proc.stderr)
    assert m is not None, proc.stderr[-2000:]
    # the figure itself is a timing (on a loaded 2-core machine it reached 1.5%): the run reports
    # it, and the suite asserts no timings; what keeps it small is structural (one background
    # thread fed by a queue: the training thread writes a JSONL line and enqueues)
    assert 0 <= float(m.group(2)) < 100, m.group(0)


@pytest.mark.parametrize("backend,module", [("wandb", "wandb"), ("trackio", "trackio"), ("mlflow", "mlflow")])
def test_a_backend_not_installed_is_refused_with_how_to_install_it(tmp_path, capsys, monkeypatch, backend,
                                                                   module):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    cfg = _setup(tmp_path, steps=2, every=0, world=1, extra=f'[log]\nbackends = ["jsonl", "{backend}"]\n')
    assert cli.main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert str(cfg) in err and f"log.backends asks for {backend}" in err
    assert f"pip install 'odcfn[{backend}]'" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before anything ran


def test_an_unknown_backend_is_named(tmp_path, capsys):
    cfg = _setup(tmp_path, steps=2, every=0, world=1, extra='[log]\nbackends = ["jsonl", "neptune"]\n')
    assert cli.main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "log.backends" in err and "neptune" in err and "wandb" in err
