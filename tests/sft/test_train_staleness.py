"""``odcfn train`` with ``[train] staleness`` (docs/staleness.md, "With odcfn train").

- Bad values end at config load, naming the file and the key (and the key it clashes with).
- A τ = 1 run on 2 in-process ranks, with rank 1 slowed so that rank 0 reads stale versions:
  every metrics line appears once and carries the loss of its own step (recomputed independently
  at the versions each rank read); each checkpoint is a drained state (exactly ``step`` updates:
  the replay of the run's record); and a resume from it continues exactly (the replay of the
  resumed run's record from the checkpoint, whose first step reads the resumed version).
- A rank killed mid-run under τ = 1 (processes backend, automatic restart): the run restarts
  from the last drained checkpoint and finishes with every step logged once. With staleness the
  final params depend on timing, so that test asserts the resume point, the log and the
  checkpoints, not equality with an uninterrupted run; exactness of a resume is the test above.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from pathlib import Path

import pytest
import torch

import odcfn
from odcfn import cli
from odcfn.batch import pack
from odcfn.checkpoint.memory_tier import committed, verify_all
from odcfn.checkpoint.sharded import read_manifest, read_shards
from odcfn.data.records import synthetic_records, write_jsonl
from odcfn.models import init_params, qwen_model
from odcfn.reference import replay
from odcfn.sft.config import load_config, model_config
from odcfn.step import stale
from odcfn.tree import tree_leaves

LR = 0.5
MODEL = ('[model]\nvocab_size = 40\nd_model = 16\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\nd_ff = 24\n'
         'seed = 1\n')


def _write(tmp_path: Path, train: str = "", extra: str = "", *, steps: int = 6, every: int = 3) -> Path:
    write_jsonl(tmp_path / "train.jsonl", synthetic_records([5, 9, 7, 12, 6, 8, 10, 4], 40, seed=0))
    path = tmp_path / "run.toml"
    path.write_text(
        f'out_dir = "out"\n{MODEL}[data]\npath = "train.jsonl"\nbatch_size = 4\n'
        f'[train]\nsteps = {steps}\nlr = {LR}\noptimizer = "sgd"\nworld_size = 2\n'
        f"max_tokens_per_microbatch = 24\n{train}"
        f"[checkpoint]\nevery = {every}\n{extra}"
    )
    return path


def _metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]


# --- bad input --------------------------------------------------------------------------------

BAD = [
    ("staleness = -1\n", "", "train.staleness must be an integer or a table of unit patterns to "
                              "integers >= 0, got -1"),
    ("staleness = true\n", "", "train.staleness must be"),
    ("staleness = 1.5\n", "", "train.staleness must be"),
    ("[train.staleness]\nhead = -1\n", "", "train.staleness['head'] must be an integer >= 0"),
    ("[train.staleness]\nhead = true\n", "", "train.staleness['head'] must be an integer >= 0"),
    ("[train.staleness]\nhed = 0\n\"*\" = 1\n", "", "train.staleness['hed'] matches no unit of the model"),
    ('staleness = 1\ncomm = "collective"\n', "", 'cannot be combined with train.comm = \'collective\''),
    ("staleness = 1\nmax_grad_norm = 1.0\n", "", "cannot be combined with train.max_grad_norm = 1.0"),
    ("staleness = 1\nexpert_bias_rate = 0.01\n", "", "cannot be combined with train.expert_bias_rate"),
    ("expert_bias_rate = 0.01\n", "", "train.expert_bias_rate = 0.01 needs a mixture of experts"),
    ("expert_bias_rate = -0.5\n", "", "train.expert_bias_rate must be a number >= 0, got -0.5"),
    ("staleness = 1\n", "", "cannot be combined with data.skip_empty_minibatches = true"),
]


@pytest.mark.parametrize(("train", "extra", "expect"), BAD, ids=[b[2][:40] for b in BAD])
def test_bad_staleness_config_names_the_file_and_the_key(tmp_path, train, extra, expect):
    path = _write(tmp_path, train, extra)
    if "skip_empty" in expect:
        text = path.read_text().replace("batch_size = 4\n", "batch_size = 4\nskip_empty_minibatches = true\n")
        path.write_text(text)
    if train.startswith("[train.staleness]"):  # a table after [train]'s own keys, as TOML requires
        text = path.read_text().replace(train, "")
        path.write_text(text.replace("[checkpoint]", train + "[checkpoint]"))
    with pytest.raises(ValueError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: config: ") and expect in msg, msg


def test_a_bad_key_ends_the_cli_with_one_line_and_status_2(tmp_path, capsys):
    path = _write(tmp_path, 'staleness = 2\ncomm = "collective"\n')
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    want = f"odcfn train: error: {path}: config: train.staleness = 2 cannot be combined with train.comm"
    assert len(err) == 1 and err[0].startswith(want), err


def test_a_table_of_patterns_reaches_the_step_config(tmp_path):
    path = _write(tmp_path, '[train.staleness]\nhead = 0\n"*" = 1\n')
    cfg = load_config(path)
    assert cfg.train.staleness == {"head": 0, "*": 1}
    assert odcfn.StepConfig(staleness=cfg.train.staleness).staleness == {"head": 0, "*": 1}


# --- a stale run, its checkpoints and a resume ---------------------------------------------------


def _recording(monkeypatch) -> dict[int, list]:
    """Wrap ``odcfn.train_step`` (the loop calls it by attribute): rank 1 sleeps before each step,
    so rank 0 runs ahead and reads stale versions; every rank's (batch, metrics) is kept."""
    seen: dict[int, list] = {0: [], 1: []}
    real, lock = odcfn.train_step, threading.Lock()

    def step(state, batch):
        if state.mesh.rank == 1:
            time.sleep(0.15)
        state, m = real(state, batch)
        with lock:
            seen[state.mesh.rank].append((batch, m))
        return state, m

    monkeypatch.setattr(odcfn, "train_step", step)
    return seen


def _versions(model, start_params, batches, record, start: int) -> dict[int, dict]:
    """Version ``v`` (the params after the updates of steps below ``v``) for every ``v`` from
    ``start`` to ``start + len(record)``: replays of the record's prefixes."""
    out = {start: start_params}
    for n in range(1, len(record) + 1):
        out[start + n] = replay(model, start_params, odcfn.sgd(LR), batches[:n], record[:n], start=start)
    return out


def _step_loss(model, versions, batch, ranks) -> float:
    """The minibatch loss of one stale step, from scratch: each rank's samples at the params
    mixing, unit by unit, the versions that rank read."""
    total = 0.0
    with torch.no_grad():
        for samples, read in ranks:
            tree = {u: versions[v][u] for u, v in read.items()}
            total += sum(float(model.apply(tree, pack(batch, [i]))) for i in samples)
    return total / batch.num_loss_tokens


def _checkpoint(tmp_path: Path, model, step: int) -> dict:
    ck = tmp_path / "out" / "checkpoints" / f"step-{step:08d}"
    assert read_manifest(ck)["step"] == step
    return odcfn.unshard([read_shards(ck, model=model, mesh=odcfn.Mesh(2, r))[0] for r in range(2)],
                         model, odcfn.Mesh(2))


def _err(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(tree_leaves(a), tree_leaves(b)))


def test_a_stale_run_logs_each_loss_once_saves_drained_states_and_resumes_exactly(tmp_path, monkeypatch):
    path = _write(tmp_path, "staleness = 1\n")
    qcfg = model_config(load_config(path))
    model = qwen_model(qcfg)
    seen = _recording(monkeypatch)
    assert cli.main(["train", "--config", str(path), "--steps", "3", "--quiet"]) == 0
    first = {r: list(v) for r, v in seen.items()}
    for v in seen.values():
        v.clear()
    assert cli.main(["train", "--config", str(path), "--quiet"]) == 0  # resumes at 3, runs 3..6

    recs = _metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]  # each step once, in order
    assert all(r["syncs"] == 0 and r["staleness_max"] <= 1 for r in recs)
    assert any(r["staleness_max"] == 1 for r in recs)  # rank 0 did read a stale version
    batches = [b for b, _ in first[0]] + [b for b, _ in seen[0]]
    assert len(batches) == 6 and all(len(v) == 3 for part in (first, seen) for v in part.values())
    rec_a = stale.record([[m for _, m in first[r]] for r in range(2)])
    rec_b = stale.record([[m for _, m in seen[r]] for r in range(2)])
    # the resumed run's version ring starts at the resumed step: its first step reads version 3
    assert all(v == 3 for _, read in rec_b[0] for v in read.values())

    # the checkpoint of step 3 is the drained state: exactly 3 updates, by the run's record
    start = init_params(qcfg, seed=1)
    versions = _versions(model, start, batches[:3], rec_a, 0)
    at3 = _checkpoint(tmp_path, model, 3)
    assert _err(at3, versions[3]) < 2e-6
    sync = [[(s, {u: k for u in read}) for s, read in r] for k, r in enumerate(rec_a)]
    assert _err(at3, replay(model, start, odcfn.sgd(LR), batches[:3], sync)) > 1e-3  # staleness mattered
    # the resume continued exactly: the final checkpoint is the replay of the resumed run's
    # record starting from the checkpoint of step 3
    versions.update(_versions(model, at3, batches[3:], rec_b, 3))
    assert _err(_checkpoint(tmp_path, model, 6), versions[6]) < 2e-6
    # every line's loss is its own step's: recomputed at the versions each rank read
    for k, ranks in enumerate(rec_a + rec_b):
        assert recs[k]["loss"] == pytest.approx(_step_loss(model, versions, batches[k], ranks), rel=1e-5)
        assert math.isfinite(recs[k]["grad_norm"]) and recs[k]["grad_norm"] > 0


# --- a killed rank under τ = 1 ------------------------------------------------------------------


def test_a_rank_killed_under_staleness_restarts_from_a_drained_checkpoint(tmp_path, monkeypatch, capfd):
    shm = tmp_path / "shm"
    shm.mkdir()
    path = _write(tmp_path, 'staleness = 1\nbackend = "processes"\nmax_restarts = 1\ntimeout = 30.0\n',
                  "async_save = false\n", every=2)
    # rank 1 dies (SIGKILL) at the start of step 5, after step 4's checkpoint is committed
    # (async_save = false: every rank returns from a save only once it is committed)
    env = {"ODCFN_TEST_KILL_AT": "step:5:1", "ODCFN_SHM_DIR": str(shm), "OMP_NUM_THREADS": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # `odcfn train` in this process (torch is imported already); its ranks are spawned processes
    rc = cli.main(["train", "--config", str(path), "--quiet"])
    captured = capfd.readouterr()
    out = captured.out + captured.err
    assert rc == 0, out[-4000:]
    assert out.count("restarting all ranks") == 1, out[-4000:]
    assert re.findall(r"resuming at step (\d+)", out) == ["4"], out[-4000:]
    recs = _metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]  # nothing lost, nothing doubled
    assert all(math.isfinite(r["loss"]) and r["staleness_max"] <= 1 for r in recs)
    ck = tmp_path / "out" / "checkpoints"
    for _, d in committed(ck):
        verify_all(d)
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]
    assert read_manifest(ck / "step-00000006")["step"] == 6
    assert not any(shm.iterdir()), sorted(p.name for p in shm.iterdir())  # no segment left behind


# --- [train] expert_bias_rate ---------------------------------------------------------------------


def test_expert_bias_rate_trains_the_bias_and_a_resume_continues_it(tmp_path):
    """A Qwen3-MoE checkpoint trained with ``expert_bias_rate``: the bias moves, is saved with each
    checkpoint, and a resume starts from the saved bias (not from zeros): 2 + 1 steps leave the
    same bias as 3 uninterrupted steps (it moves by a fixed rate per expert and step, from the
    loads: exact)."""
    from odcfn.checkpoint.state_io import ROUTER_BIAS
    from tests.hf_moe_families import hf_moe_model

    src = tmp_path / "src"
    hf_moe_model("qwen3_moe", vocab_size=40).save_pretrained(src)

    def run(name: str, *steps: str) -> list:
        root = tmp_path / name
        root.mkdir()
        write_jsonl(root / "train.jsonl", synthetic_records([5, 9, 7, 12, 6, 8], 40, seed=0))
        (root / "run.toml").write_text(
            f'out_dir = "out"\n[model]\nhf_path = "{src}"\n[data]\npath = "train.jsonl"\nbatch_size = 3\n'
            '[train]\nsteps = 3\nlr = 1e-2\nworld_size = 2\nexpert_bias_rate = 0.01\n'
            '[checkpoint]\nevery = 1\n')
        for s in steps:
            assert cli.main(["train", "--config", str(root / "run.toml"), "--quiet", *s.split()]) == 0
        ck = root / "out" / "checkpoints"
        return [read_manifest(ck / f"step-{k:08d}")["extra"][ROUTER_BIAS] for k in (2, 3)]

    straight = [torch.tensor(b) for b in run("straight", "")]
    resumed = [torch.tensor(b) for b in run("resumed", "--steps 2", "")]
    assert torch.equal(straight[0], resumed[0]) and straight[0].abs().sum() > 0
    assert torch.allclose(resumed[1], straight[1], rtol=0, atol=1e-9)  # continued from step 2's bias
    assert not torch.allclose(straight[1], straight[0])  # and the third step moved it again
