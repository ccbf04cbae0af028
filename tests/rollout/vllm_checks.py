"""The vLLM engine's checks, run as a script in a subprocess (vLLM spawns processes, so the code
that starts it must sit under ``if __name__ == "__main__":``): ``python -m tests.vllm_checks
SCENARIO OUT.json``. One engine per scenario (a start costs ~25 s or more); the numbers it writes
are asserted by tests/test_rollout_vllm.py.

Scenarios: ``dense`` (full fine-tuning on 2 ranks, rank 0 hosting the engine, rank 1 joining the
syncs without one), ``lora`` and ``moe`` (Qwen3-MoE), one rank each; ``learn``: the learning task
of tests/rl/test_rl_loop.py (first new token = 5, chance 1/16) through ``odcfn.rl.step`` on 2
ranks, each with its own ``VLLMEngine``, synchronously and then in one-step asynchronous mode
(``learn-local``: the same with ``LocalEngine``, to compare)."""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from typing import Any

import torch

import odcfn
from odcfn import rl
from odcfn.models import QwenConfig, QwenMoeConfig, init_params, qwen_model
from odcfn.models.hf import to_hf
from odcfn.rollout import LocalEngine, SamplingParams
from odcfn.rollout.vllm_engine import VLLMEngine, sync_weights
from tests.memtrack import TensorBytes

# head_dim 64: vLLM's CPU attention refuses head_dim 16
DENSE = QwenConfig(vocab_size=128, d_model=128, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=256, head_dim=64)
MOE = QwenMoeConfig(vocab_size=128, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=256, head_dim=64,
                    qk_norm=True, qkv_bias=False, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=64, norm_topk_prob=True)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [20, 30, 40, 50, 60, 70], [100, 3]]
SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, top_k=7, top_p=0.9, n=2, seed=11)
PLAIN = SamplingParams(max_tokens=12, temperature=1.3, n=2, seed=5)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
STEPS = 3
BUCKET_MB = 0.25


def _batch(seqs: list[list[int]]) -> odcfn.Batch:
    return odcfn.Batch(tuple(odcfn.Sample(torch.tensor(s)) for s in seqs))


def _train_batch(cfg: QwenConfig, step: int) -> odcfn.Batch:
    return odcfn.random_batch([16, 24, 12, 20], cfg.vocab_size, seed=100 + step)


def _hf_greedy(cfg: QwenConfig, full: dict, prompts: list[list[int]], n: int) -> list[list[int]]:
    import transformers

    with tempfile.TemporaryDirectory() as d:
        to_hf(d, full, cfg)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                          pad_token_id=0, eos_token_id=None)
        out.append(ids[0, len(p):].tolist())
    return out


def _check(state: Any, engine: VLLMEngine | None, shared: dict, barrier: threading.Barrier,
           lora: bool) -> dict:
    """One round of comparisons on the engine's current weights (every rank joins log_probs and
    the gather of the full weights transformers' greedy decode runs on)."""
    res: dict[str, Any] = {}
    if engine is not None:
        shared["fixed"] = [p + [(7 * i + 3 * j) % 128 for j in range(9)] for i, p in enumerate(PROMPTS)]
        shared["score"] = engine.score(shared["fixed"])
        shared["sampled"] = {"topk": engine.generate(PROMPTS, SAMPLED),
                             "plain": engine.generate(PROMPTS, PLAIN)}
        shared["greedy"] = engine.generate(PROMPTS, GREEDY)
    barrier.wait()
    lp = odcfn.log_probs(state, _batch(shared["fixed"]))
    res["score_err"] = max((a - b).abs().max().item() for a, b in zip(lp, shared["score"]))
    for name, sp in (("topk", SAMPLED), ("plain", PLAIN)):
        comps = shared["sampled"][name]
        seqs = [PROMPTS[c.prompt_index] + c.tokens.tolist() for c in comps]
        ref = odcfn.log_probs(state, _batch(seqs), temperature=sp.temperature)
        res[f"{name}_err"] = max((r[len(PROMPTS[c.prompt_index]):] - c.logprobs).abs().max().item()
                                 for r, c in zip(ref, comps))
    full = (odcfn.lora.gather_merged if lora else odcfn.gather_params)(state, 0)
    if engine is not None:
        res["greedy_equal"] = [c.tokens.tolist() for c in shared["greedy"]] == _hf_greedy(
            engine.cfg, full, PROMPTS, GREEDY.max_tokens)
    barrier.wait()  # nobody overwrites ``shared`` before every rank has read it
    return res


def run(scenario: str) -> dict:
    cfg = MOE if scenario == "moe" else DENSE
    model, full = qwen_model(cfg), init_params(cfg, seed=1)
    if scenario == "lora":
        targets = ("q_proj", "v_proj", "down_proj")
        model, full = odcfn.lora.apply(model, full, rank=4, alpha=8, targets=targets)
    world = 2 if scenario == "dense" else 1
    engine = VLLMEngine(model, cfg, params=full, max_model_len=64, bucket_mb=BUCKET_MB,
                        kv_cache_memory_bytes=64 << 20)
    out: dict[str, Any] = {"rounds": [], "syncs": [], "model_bytes": sum(
        t.numel() * t.element_size() for u in full.values() for t in _flat(u))}
    shared: dict = {}
    barrier = threading.Barrier(world)

    def body(rank: int, tr: Any) -> list:
        eng = engine if rank == 0 else None
        state = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.adamw(3e-3), transport=tr,
                                        config=odcfn.StepConfig(balance="round_robin"))
        lora = scenario == "lora"
        rounds = [_check(state, eng, shared, barrier, lora)]
        for step in range(STEPS):
            state, _ = odcfn.train_step(state, _train_batch(cfg, step))
            if eng is None:
                sync_weights(state, int(BUCKET_MB * 2**20))  # a rank without an engine joins the gathers
            else:
                with TensorBytes() as mem:
                    eng.update_weights(state)
                s = eng.last_sync
                row = {**s.__dict__, "trainer_peak_tensor_bytes": mem.peak, "version": eng.version}
                out["syncs"].append(row)
            rounds.append(_check(state, eng, shared, barrier, lora))
        return rounds

    try:
        by_rank = odcfn.run_local(body, world, timeout=900)
        if scenario == "dense":  # a completion is a function of (seed, prompt position, index in group)
            a = engine.generate(PROMPTS, SAMPLED)
            b = engine.generate(PROMPTS[:2] + [[77, 78]], SAMPLED)
            out["seeded_same"] = [c.tokens.tolist() for c in a[:4]] == [c.tokens.tolist() for c in b[:4]]
            stop = engine.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=1.0, seed=2,
                                                           stop_token_ids=tuple(range(0, 128, 3))))
            out["stops"] = [(c.finish_reason, c.tokens.tolist()) for c in stop]
    finally:
        engine.close()
    out["rounds"] = by_rank
    return out


# the learning task's model: tests/rl/test_rl_loop.py's, with the head_dim vLLM's CPU attention takes
LEARN = QwenConfig(vocab_size=16, d_model=64, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=64, head_dim=64)
LEARN_ITERS = 15


def learn(engine_kind: str) -> dict:
    """Per mode (sync, async): each rank's per-iteration mean reward, its largest engine/trainer
    log-prob gap (sync mode: the engine sampled with the weights the trainer scores with) and
    its engine's final version. The engines start once and serve both runs (each run's first
    ``update_weights`` puts the initial weights back)."""
    from tests.rl.test_rl_loop import prompts_at, target_reward

    model, full = qwen_model(LEARN), init_params(LEARN, seed=3)
    if engine_kind == "vllm":  # started here, not in the rank threads: vLLM wants the main thread
        engines = [VLLMEngine(model, LEARN, params=full, max_model_len=16, kv_cache_memory_bytes=16 << 20)
                   for _ in range(2)]
    else:
        engines = [LocalEngine(model, LEARN, params=full, max_model_len=16) for _ in range(2)]
    out: dict[str, Any] = {}
    try:
        for mode in ("sync", "async"):
            asynchronous = mode == "async"
            loss = odcfn.losses.policy_gradient(decoupled=asynchronous, clip_ratio_high=0.28)
            config = rl.RLConfig(reward=target_reward, group_size=8, loss=loss, async_rollouts=asynchronous,
                                 sampling=SamplingParams(max_tokens=2, temperature=1.0))

            def body(rank: int, tr: Any, loss: Any = loss, config: Any = config) -> dict:
                state = odcfn.TrainState.create(
                    params=full, model=model, optimizer=odcfn.adamw(1e-2, weight_decay=0.0), transport=tr,
                    config=odcfn.StepConfig(balance="lb_mini", loss=loss))
                engine = engines[rank]
                engine.update_weights(state)
                scores, gaps = [], []
                for it in range(LEARN_ITERS):
                    nxt = prompts_at(it + 1) if config.async_rollouts and it + 1 < LEARN_ITERS else None
                    state, m = rl.step(state, engine, prompts_at(it), config, next_prompts=nxt)
                    scores.append(m.extra["critic/score/mean"])
                    gaps.append(m.extra.get("rollout/logprob_diff/max", float("nan")))
                return {"scores": scores, "logprob_diff_max": gaps, "version": engine.version,
                        "step": int(state.step)}

            t0 = time.perf_counter()
            out[mode] = odcfn.run_local(body, 2, timeout=900)
            out[f"{mode}_seconds"] = time.perf_counter() - t0
    finally:
        for e in engines:
            e.close()
    return out


def _flat(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _flat(v)]
    return [tree]


if __name__ == "__main__":
    torch.set_num_threads(1)
    scenario = sys.argv[1]
    if scenario.startswith("learn"):
        result = learn("local" if scenario == "learn-local" else "vllm")
    else:
        result = run(scenario)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f, indent=1)
