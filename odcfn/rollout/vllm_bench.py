"""Weight sync into a running ``VLLMEngine``: streamed buckets against a gather-then-reload.

``bench_weight_sync(state, engine)`` (every rank calls it; ``engine`` is None on a rank that
hosts none) times both, side by side on the same weights:

- ``streamed``: ``engine.update_weights(state)``: units gathered bucket by bucket, each bucket
  written to one shared file and loaded by vLLM in place (``odcfn.rollout.vllm_engine``);
- ``full_reload``: ``odcfn.gather_params(state, dst=host)``, the whole model on the host rank,
  then loaded by vLLM in one reload (what a ``load_state_dict`` of the full model does).

Memory is measured two ways: the largest set of weights the trainer side holds at once (exact,
from the plan) and the resident-set peaks (VmHWM, reset before each run) of the trainer process
(every in-process rank together) and of vLLM's worker process.
"""

from __future__ import annotations

import time
from typing import Any

import odcfn
from odcfn.rollout.vllm_engine import VLLMEngine, bucket_layout, shm_dir, sync_weights, write_bucket
from odcfn.rollout.vllm_worker import peak_rss_bytes, reset_peak_rss

__all__ = ["bench_weight_sync"]


def _full_reload(state: Any, engine: VLLMEngine | None, host: int) -> dict[str, Any]:
    """The baseline: the full model gathered to ``host``, then one reload of all of it."""
    import os
    import tempfile

    import torch

    from odcfn.models.hf_names import hf_state_dict

    t0 = time.perf_counter()
    lora = bool(odcfn.lora.adapter_units(state.model))
    full = (odcfn.lora.gather_merged if lora else odcfn.gather_params)(state, host)
    gather_s = time.perf_counter() - t0
    if engine is None:
        return {"seconds": time.perf_counter() - t0, "gather_s": gather_s}
    named = list(hf_state_dict(full).items())
    del full
    meta, nbytes = bucket_layout(named)
    fd, path = tempfile.mkstemp(prefix="odcfn-vllm-full-", dir=shm_dir())
    os.ftruncate(fd, nbytes)
    os.close(fd)
    try:
        buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        write_bucket(buf, meta, named)
        del named
        engine.sync_rpc("begin_sync", path, nbytes)
        engine.sync_rpc("load_bucket", meta)
        report = engine.sync_rpc("end_sync")
        del buf
    finally:
        os.unlink(path)
    engine.reset_prefix_cache()
    return {"seconds": time.perf_counter() - t0, "gather_s": gather_s, "held_bytes": nbytes,
            "engine_rss_before": report["rss_before"], "engine_peak_rss": report["peak_rss"]}


def bench_weight_sync(state: Any, engine: VLLMEngine | None, *, host: int = 0, repeat: int = 3,
                      bucket_mb: float | None = None) -> dict[str, Any] | None:
    """Both syncs ``repeat`` times, alternating; on the host rank (the one whose ``engine`` is
    not None, ``host``) a dict ``{"streamed": [...], "full_reload": [...], "model_bytes": ...}``
    with one dict per run (seconds, bytes the trainer held at once, RSS peaks); None elsewhere.
    ``bucket_mb``: the streamed sync's bucket on ranks without an engine (must equal the
    engine's)."""
    bucket = engine.bucket_bytes if engine is not None else int((bucket_mb or 256) * 2**20)
    out: dict[str, Any] = {"streamed": [], "full_reload": []}
    for _ in range(repeat):
        reset_peak_rss()
        rss0 = peak_rss_bytes()[0]
        if engine is None:
            sync_weights(state, bucket)
        else:
            engine.update_weights(state)
            s = engine.last_sync
            out["model_bytes"] = s.bytes
            out["streamed"].append({
                "seconds": s.seconds, "gather_s": s.gather_s, "push_s": s.push_s, "buckets": s.buckets,
                # the gathered bucket and the bucket file
                "held_bytes": 2 * s.max_bucket_bytes,
                "trainer_rss_peak_delta": peak_rss_bytes()[1] - rss0,
                "engine_rss_peak_delta": s.engine_peak_rss - s.engine_rss_before,
            })
        reset_peak_rss()
        rss0 = peak_rss_bytes()[0]
        r = _full_reload(state, engine, host)
        if engine is not None:
            # the full tree, its Hugging Face copy in the file
            r["held_bytes"] = 2 * r["held_bytes"]
            r["trainer_rss_peak_delta"] = peak_rss_bytes()[1] - rss0
            r["engine_rss_peak_delta"] = r.pop("engine_peak_rss") - r.pop("engine_rss_before")
            out["full_reload"].append(r)
    return out if engine is not None else None


def main(argv: list[str] | None = None) -> None:
    """``python -m odcfn.rollout.vllm_bench [--layers 8 --d-model 512 --world 2 --bucket-mb 16]``:
    a model built from a config (no download), trained one step on ``--world`` in-process ranks,
    rank 0 hosting the engine; prints the result as JSON."""
    import argparse
    import json
    import threading

    import torch

    from odcfn.models import QwenConfig, init_params, qwen_model

    ap = argparse.ArgumentParser(prog="python -m odcfn.rollout.vllm_bench")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    cfg = QwenConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=a.d_model // 64,
                     n_kv_heads=max(1, a.d_model // 256), d_ff=3 * a.d_model, head_dim=64)
    model, full = qwen_model(cfg), init_params(cfg)
    engine = VLLMEngine(model, cfg, params=full, max_model_len=256, bucket_mb=a.bucket_mb,
                        kv_cache_memory_bytes=256 << 20)
    del full
    lock = threading.Lock()

    def body(rank: int, tr: Any) -> Any:
        with lock:  # one rank at a time builds its state from fresh full params
            params = init_params(cfg)
        state = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.adamw(1e-4), transport=tr,
                                        config=odcfn.StepConfig(balance="round_robin"))
        del params
        state, _ = odcfn.train_step(state, odcfn.random_batch([32, 32], cfg.vocab_size))
        return bench_weight_sync(state, engine if rank == 0 else None, repeat=a.repeat, bucket_mb=a.bucket_mb)

    try:
        torch.set_num_threads(1)
        res = odcfn.run_local(body, a.world, timeout=1800)[0]
    finally:
        engine.close()
    print(json.dumps({"config": vars(a), "params": cfg.num_params, **res}, indent=1))


if __name__ == "__main__":
    main()
