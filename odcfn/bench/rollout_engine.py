"""The local rollout engine's tokens/s against transformers' ``generate`` on the same model and
batch (issue 36: target >= 1x).

One model, built from a config (no download), exported with ``odcfn.models.to_hf`` and loaded by
transformers; the same prompts (equal lengths, so transformers needs no padding); both generate
exactly ``new_tokens`` per prompt (no stop token; ``min_new_tokens`` on transformers' side),
greedy and sampled (temperature 1, no top-k/top-p on either side); then greedy with stop tokens,
where lengths vary and each side's tokens are counted up to each row's first stop. Each side runs once to warm
up, then ``repeats`` rounds, the two sides interleaved; the best time of each counts (the
machine is shared: the minimum is the least disturbed run).
``python -m odcfn.bench.rollout_engine`` prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["bench_rollout_engine", "main"]


def _best(fns: Sequence[Callable[[], Any]], repeats: int) -> list[tuple[float, float]]:
    """``(best wall time, best process CPU time)`` of each function over ``repeats`` rounds, the
    functions interleaved in each round (so a burst of load on the shared machine hits both sides
    alike). With one thread the CPU time is the work itself, not the wait for a core: on a
    loaded machine it is the steadier figure."""
    for fn in fns:
        fn()  # warm-up: first-call allocations, lazy imports
    best = [(float("inf"), float("inf"))] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            w, c = time.perf_counter() - w0, time.process_time() - c0
            best[i] = (min(best[i][0], w), min(best[i][1], c))
    return best


def bench_rollout_engine(
    *, prompts: int = 32, prompt_len: int = 32, new_tokens: int = 64, d_model: int = 256, n_layers: int = 4,
    vocab_size: int = 4096, repeats: int = 3, threads: int | None = None, seed: int = 0,
) -> dict[str, Any]:
    """``{"tokens", "engine_tok_s", "hf_tok_s", "ratio", "ratio_cpu"}`` for greedy, sampled and
    greedy-with-stop-tokens decoding (keys suffixed ``_greedy`` / ``_sample`` / ``_stop``;
    ``ratio``: the engine's tokens per wall second over transformers', at each side's best run;
    ``ratio_cpu``: the same per process CPU second), plus the setting."""
    import transformers

    from odcfn.models import QwenConfig, init_params, qwen_model, to_hf
    from odcfn.rollout import LocalEngine, SamplingParams

    if threads:
        torch.set_num_threads(threads)
    cfg = QwenConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                     d_ff=4 * d_model)
    g = torch.Generator().manual_seed(seed)
    params = init_params(cfg, seed=seed)
    ids = torch.randint(0, vocab_size, (prompts, prompt_len), generator=g)
    engine = LocalEngine(qwen_model(cfg), cfg, params=params, max_model_len=prompt_len + new_tokens,
                         max_batch_tokens=prompts * (prompt_len + new_tokens))
    with tempfile.TemporaryDirectory() as d:
        to_hf(d, params, cfg)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).train(False)
    out: dict[str, Any] = {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens,
                           "d_model": d_model, "n_layers": n_layers, "vocab_size": vocab_size,
                           "threads": torch.get_num_threads()}
    mask = torch.ones_like(ids)
    stops = tuple(range(0, vocab_size, 32))  # "stop": 1/32 of the vocabulary ends a completion
    greedy = dict(do_sample=False)
    modes = {  # name: (engine's sampling, transformers' generate keywords)
        "greedy": (SamplingParams(max_tokens=new_tokens, temperature=0.0),
                   dict(greedy, min_new_tokens=new_tokens)),
        "sample": (SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=seed),
                   dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_new_tokens=new_tokens)),
        # long-tailed lengths, as RL rollouts have: finished rows leave the engine's batch, while
        # transformers keeps computing them (padded) until the longest one is done
        "stop": (SamplingParams(max_tokens=new_tokens, temperature=0.0, stop_token_ids=stops),
                 dict(greedy, eos_token_id=list(stops))),
    }
    for mode, (sp, kw) in modes.items():
        made = {}

        def run_engine(sp: SamplingParams = sp, made: dict = made) -> None:
            made["engine"] = sum(c.length for c in engine.generate(ids.tolist(), sp))

        def run_hf(kw: dict = kw, made: dict = made) -> None:
            with torch.no_grad():
                got = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=0, **kw)
            new = got[:, prompt_len:]
            is_stop = torch.isin(new, torch.tensor(stops)) & ("eos_token_id" in kw)
            # a row's tokens: up to and including its first stop token (the rest is padding)
            first = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, new.shape[1])
            made["hf"] = int(first.sum())

        (w_engine, c_engine), (w_hf, c_hf) = _best([run_engine, run_hf], repeats)
        out[f"tokens_{mode}"] = made["engine"]
        out[f"engine_tok_s_{mode}"] = round(made["engine"] / w_engine, 1)
        out[f"hf_tok_s_{mode}"] = round(made["hf"] / w_hf, 1)
        out[f"ratio_{mode}"] = round(made["engine"] / w_engine / (made["hf"] / w_hf), 3)
        out[f"ratio_cpu_{mode}"] = round(made["engine"] / c_engine / (made["hf"] / c_hf), 3)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("prompts", 32), ("prompt-len", 32), ("new-tokens", 64), ("d-model", 256),
                          ("n-layers", 4), ("vocab-size", 4096), ("repeats", 3), ("threads", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args(argv)
    res = bench_rollout_engine(prompts=a.prompts, prompt_len=a.prompt_len, new_tokens=a.new_tokens,
                               d_model=a.d_model, n_layers=a.n_layers, vocab_size=a.vocab_size,
                               repeats=a.repeats, threads=a.threads or None)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
