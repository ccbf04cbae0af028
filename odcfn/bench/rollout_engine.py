"""The local rollout engine's tokens/s against transformers' ``generate`` on the same model and
batch (issue 36: target >= 1x).

One model, built from a config (no download), exported with ``odcfn.models.to_hf`` and loaded by
transformers; the same prompts (equal lengths, so transformers needs no padding); both generate
exactly ``new_tokens`` per prompt (no stop token; ``min_new_tokens`` on transformers' side),
greedy and sampled (temperature 1, no top-k/top-p on either side). Each side runs once to warm
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


def _best(fns: Sequence[Callable[[], Any]], repeats: int) -> list[float]:
    """The best time of each function over ``repeats`` rounds, the functions interleaved in each
    round (so a burst of load on the shared machine hits both sides alike)."""
    for fn in fns:
        fn()  # warm-up: first-call allocations, lazy imports
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def bench_rollout_engine(
    *, prompts: int = 32, prompt_len: int = 32, new_tokens: int = 64, d_model: int = 256, n_layers: int = 4,
    vocab_size: int = 4096, repeats: int = 3, threads: int | None = None, seed: int = 0,
) -> dict[str, Any]:
    """``{"engine_tok_s", "hf_tok_s", "ratio"}`` for greedy and sampled decoding (keys suffixed
    ``_greedy`` / ``_sample``), plus the setting."""
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
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    out: dict[str, Any] = {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens,
                           "d_model": d_model, "n_layers": n_layers, "vocab_size": vocab_size,
                           "threads": torch.get_num_threads()}
    total = prompts * new_tokens
    mask = torch.ones_like(ids)
    for mode, temp in (("greedy", 0.0), ("sample", 1.0)):
        sp = SamplingParams(max_tokens=new_tokens, temperature=temp, seed=seed)
        sampled = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        hf_kw = dict(do_sample=False) if temp == 0 else sampled

        def run_engine(sp: SamplingParams = sp) -> None:
            got = engine.generate(ids.tolist(), sp)
            assert sum(c.length for c in got) == total

        def run_hf(kw: dict = hf_kw) -> None:
            with torch.no_grad():
                got = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, pad_token_id=0, **kw)
            assert got.shape == (prompts, prompt_len + new_tokens)

        t_engine, t_hf = _best([run_engine, run_hf], repeats)
        out[f"engine_tok_s_{mode}"] = round(total / t_engine, 1)
        out[f"hf_tok_s_{mode}"] = round(total / t_hf, 1)
        out[f"ratio_{mode}"] = round(t_hf / t_engine, 3)
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
