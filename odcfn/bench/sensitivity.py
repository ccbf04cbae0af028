"""Per-unit gradient sensitivity S(u) (``odcfn.step.sensitivity``) on a small model, before and
after some training: which units automatic hybrid synchronisation would keep synchronous.

A 4-layer model learns to continue counting sequences (each token the previous one plus a
per-sample stride, modulo the vocabulary): random tokens would make every gradient pure noise,
so every unit would score alike. W in-process ranks; S(u) is measured on the same held-out
minibatches at step 0 and after ``steps`` synchronous SGD steps.

``python -m odcfn.bench.sensitivity`` prints the table (docs/staleness.md has one).
"""

from __future__ import annotations

import random
from typing import Any

import torch

import odcfn
from odcfn.batch import Batch, Sample
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.step import sensitivity

__all__ = ["bench_sensitivity", "counting_batch", "main"]


def counting_batch(samples: int, vocab: int, rng: random.Random) -> Batch:
    """``samples`` counting sequences of 24 to 48 tokens, stride 1 to 4, random start."""
    out = []
    for _ in range(samples):
        n, stride, start = rng.randint(24, 48), rng.randint(1, 4), rng.randrange(vocab)
        out.append(Sample((start + stride * torch.arange(n)) % vocab))
    return Batch(tuple(out))


def bench_sensitivity(
    *, world: int = 2, steps: int = 40, probes: int = 6, samples: int = 8, lr: float = 0.5,
    keep: float = 0.25, seed: int = 0,
) -> dict[str, Any]:
    """``{"before": scores, "after": scores, "loss": (first, last), "numel": {unit: params},
    "kept": units hybrid(after, keep) keeps at τ = 0}``."""
    cfg = QwenConfig(vocab_size=64, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128)
    model, full = qwen_model(cfg), init_params(cfg, seed=seed)
    rng = random.Random(seed)
    probe = [counting_batch(samples, cfg.vocab_size, rng) for _ in range(probes)]
    train = [counting_batch(samples, cfg.vocab_size, rng) for _ in range(steps)]

    def fn(rank: int, tr: Any) -> dict[str, Any]:
        st = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(lr), transport=tr)
        before = sensitivity.measure(st, probe)
        losses = []
        for b in train:
            st, m = odcfn.train_step(st, b)
            losses.append(m.loss)
        return {"before": before, "after": sensitivity.measure(st, probe), "loss": (losses[0], losses[-1])}

    res = odcfn.run_local(fn, world, timeout=600)[0]
    layout = odcfn.make_layout(model, odcfn.Mesh(1, 0))
    res["numel"] = {u.name: u.numel for u in layout.units}
    taus = sensitivity.hybrid(res["after"], 1, keep=keep)
    res["kept"] = [u for u, t in taus.items() if t == 0]
    return res


def main() -> None:
    res = bench_sensitivity()
    print(f"loss {res['loss'][0]:.3f} at step 0, {res['loss'][1]:.3f} at the last step")
    print("| unit | params | S(u) at step 0 | S(u) after training | τ (keep 0.25, after) |")
    print("|---|---|---|---|---|")
    for u, s in res["before"].items():
        tau = 0 if u in res["kept"] else 1
        print(f"| {u} | {res['numel'][u]:,} | {s:.3f} | {res['after'][u]:.3f} | {tau} |")


if __name__ == "__main__":
    main()
