"""Does training still work with low-precision communication? A small task, fixed seed, the
held-out loss of each wire setting against the bf16 run (``odcfn bench --only tiers`` runs 200
steps; tests/step/test_wire_training.py a shorter run with the same function).

The task: sequences whose next token is the previous one plus 1, 2 or 3 (mod V), uniformly, so
the best achievable loss is ln 3 and a model that learns the rule moves from ln V toward it.
Held-out loss: the fp32 loss of the gathered (unquantized) parameters on sequences of another
seed, computed in one process (``odcfn.reference_loss``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import odcfn
from odcfn.batch import Batch, Sample
from odcfn.models import QwenConfig, init_params, qwen_model

__all__ = ["CONFIG", "RUNS", "task_batch", "training_curves"]

CONFIG = QwenConfig(vocab_size=37, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
BF16 = {"compute_dtype": torch.bfloat16}
RUNS: dict[str, dict[str, Any]] = {
    "bf16": BF16,
    "fp8 gathers + bf16 pushes": {**BF16, "gather_format": "fp8_e4m3", "push_format": "bf16"},
    "int8 pushes + error feedback": {**BF16, "push_format": "int8", "push_error_feedback": True},
    "fp8 gathers + int8 pushes + error feedback": {
        **BF16,
        "gather_format": "fp8_e4m3",
        "push_format": "int8",
        "push_error_feedback": True,
    },
}


def task_batch(samples: int, length: int, vocab: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(samples):
        steps = torch.randint(1, 4, (length - 1,), generator=g)
        start = torch.randint(0, vocab, (1,), generator=g)
        rows.append(Sample(torch.cat([start, start + steps.cumsum(0)]) % vocab))
    return Batch(tuple(rows))


def _run(
    cfg: dict[str, Any], steps: int, world: int, every: int, seed: int, lr: float, config: QwenConfig
) -> list[tuple[int, float]]:
    model, full = qwen_model(config), init_params(config, seed=seed)
    held = task_batch(16, 24, config.vocab_size, seed + 1000)

    def fn(rank: int, tr: Any) -> list[tuple[int, float]]:
        state = odcfn.TrainState.create(
            params=full,
            model=model,
            optimizer=odcfn.adamw(lr),
            transport=tr,
            config=odcfn.StepConfig(balance="lb_mini", **cfg),
        )
        curve = []
        for step in range(steps + 1):
            if step % every == 0 or step == steps:
                params = odcfn.gather_params(state, dst=0, dtype=torch.float32)
                if params is not None:
                    curve.append((step, float(odcfn.reference_loss(model, params, held))))
            if step < steps:
                batch = task_batch(8, 24, config.vocab_size, seed * 100_000 + step)
                state, _ = odcfn.train_step(state, batch)
        return curve

    return odcfn.run_local(fn, world, timeout=120)[0]


def training_curves(
    steps: int = 200,
    *,
    world: int = 2,
    every: int = 10,
    seed: int = 0,
    lr: float = 3e-3,
    runs: dict[str, dict[str, Any]] | None = None,
    config: QwenConfig = CONFIG,
) -> dict[str, Any]:
    """Held-out loss every ``every`` steps for each run of ``runs`` (default ``RUNS``), and each
    final loss relative to the bf16 run's (``rel_to_bf16``)."""
    runs = RUNS if runs is None else runs
    curves = {name: _run(cfg, steps, world, every, seed, lr, config) for name, cfg in runs.items()}
    base = curves["bf16"][-1][1]
    return {
        "steps": steps,
        "world": world,
        "seed": seed,
        "lr": lr,
        "floor": math.log(3),
        "initial": curves["bf16"][0][1],
        "curves": curves,
        "final": {k: c[-1][1] for k, c in curves.items()},
        "rel_to_bf16": {k: c[-1][1] / base - 1 for k, c in curves.items()},
    }


def plot_curves(result: dict[str, Any], path: str) -> None:
    """The held-out loss curves of ``training_curves`` as a PNG (docs/memory.md's figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in result["curves"].items():
        ax.plot([s for s, _ in curve], [v for _, v in curve], label=f"{name} ({result['final'][name]:.4f})")
    ax.axhline(result["floor"], color="grey", linestyle=":", label="the task's floor, ln 3")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"{result['steps']} steps, {result['world']} ranks, seed {result['seed']}, bf16 compute")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
