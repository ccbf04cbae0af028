"""The bytes a rank holds of a frozen LoRA base, with and without ``StepConfig(quantize_frozen=True)``
(docs/memory.md): ``python -m odcfn.bench.tiers_frozen``.

Two ranks on threads (``odcfn.run_local``), one LoRA step per row; each row reports rank 0's
frozen bytes in its state (``odcfn.state_bytes``) and in its transport's publication (the copy
peers gather from, as ``begin_step`` left it), against the bf16 base of the first row.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ROWS", "measure_frozen", "render"]

ROWS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("bf16 compute, bf16 gathers", {}),
    ("bf16 compute, int8 gathers, base kept in bf16", {"gather_format": "int8"}),
    ("bf16 compute, int8 gathers, quantize_frozen", {"gather_format": "int8", "quantize_frozen": True}),
    ("bf16 compute, fp8_e4m3 gathers, quantize_frozen",
     {"gather_format": "fp8_e4m3", "quantize_frozen": True}),
)


def measure_frozen(
    d_model: int = 256, n_layers: int = 4, vocab_size: int = 4096, rank: int = 8, world: int = 2
) -> list[dict[str, Any]]:
    """One dict per row of ``ROWS``: its name, state and published frozen bytes, their ratios to
    the first row's state bytes, the step's loss (equal across the held/kept rows of a format),
    and rank 0's frozen shard sizes."""
    import torch

    import odcfn
    from odcfn.models import QwenConfig, init_params, qwen_model

    cfg = QwenConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                     d_ff=int(d_model * 2.75))
    model, params = odcfn.lora.apply(qwen_model(cfg), init_params(cfg, seed=0), rank=rank, alpha=2.0 * rank)
    batch = odcfn.random_batch([64, 48, 32, 16], vocab_size, seed=0)

    def fn(r: int, tr: Any) -> list[tuple[int, int, float]]:
        out = []
        for _, kw in ROWS:
            config = odcfn.StepConfig(compute_dtype=torch.bfloat16, deterministic=True, **kw)
            state = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.adamw(1e-3),
                                            transport=tr, config=config)
            held = odcfn.state_bytes(state).frozen
            _, m = odcfn.train_step(state, batch)
            pub = tr.world.published[r]
            published = sum(pub[u].numel() * pub[u].element_size() for u in model.frozen)
            out.append((held, published, m.loss))
        return out

    got = odcfn.run_local(fn, world)[0]
    base = got[0][0]
    sizes = [u.shard_size for u in odcfn.make_layout(model, odcfn.Mesh(world)).units if u.frozen]
    return [{"row": name, "state_bytes": s, "published_bytes": p, "state_ratio": s / base,
             "published_ratio": p / base, "loss": loss, "shard_sizes": sizes}
            for (name, _), (s, p, loss) in zip(ROWS, got)]


def render(rows: list[dict[str, Any]]) -> str:
    out = ["| run | base in the state (B) | vs bf16 | base published (B) | vs bf16 | state + published "
           "| loss |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        total = r["state_bytes"] + r["published_bytes"]
        out.append(f"| {r['row']} | {r['state_bytes']:,} | {r['state_ratio']:.6f} | {r['published_bytes']:,} "
                   f"| {r['published_ratio']:.6f} | {total:,} | {r['loss']!r} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(measure_frozen()))
