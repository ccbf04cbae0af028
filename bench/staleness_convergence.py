"""Bounded staleness and convergence: held-out loss vs samples at τ = 0, 1, 2 on a learnable task.

    python bench/staleness_convergence.py                      # the docs' run (docs/staleness.md)
    python bench/staleness_convergence.py --steps 40 --lrs 5e-3 --out /tmp/conv.png

The task is a synthetic language with a known floor: a Markov chain over ``vocab`` tokens where
every token has two successors, taken with probability 0.75 and 0.25 (which two differs by token).
Each row has the same entropy, so no model can do better than ``H(0.75, 0.25) = 0.562`` nats per
token, whatever the order of states; a random init starts near ``ln(vocab)``.

Every τ trains the same model from the same init on the same minibatches, W in-process ranks.
Lags are forced, not left to timing: on a seeded random third of the minibatches one random rank
holds back before its step ``j`` until every other rank has finished step ``j + τ`` (or the next
evaluation point, or a timeout), so the others read the parameters up to τ versions behind, the
most the bound allows, as often as that schedule makes possible. The held-out loss is taken at
every ``--eval-every`` steps on the drained state (``stale.drain``: every step below applied), the
params of exactly that many updates; the lags actually read come from ``staleness_max``.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import threading
from pathlib import Path
from typing import Any

import torch

import odcfn
from odcfn.model import reference_loss
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.step import stale

PROBS = (0.75, 0.25)  # each token's two successors
FLOOR = -sum(p * math.log(p) for p in PROBS)  # nats per token: the best any model can do


def chain(vocab: int, seed: int) -> torch.Tensor:
    """A ``vocab x vocab`` transition matrix: row ``a`` puts PROBS on two distinct tokens."""
    g = torch.Generator().manual_seed(seed)
    P = torch.zeros(vocab, vocab)
    for a in range(vocab):
        succ = torch.randperm(vocab, generator=g)[: len(PROBS)]
        P[a, succ] = torch.tensor(PROBS)
    return P


def sample_batch(P: torch.Tensor, lengths: list[int], seed: int) -> odcfn.Batch:
    """Sequences of the chain from uniform first tokens."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        toks = [int(torch.randint(0, P.shape[0], (1,), generator=g))]
        for _ in range(n - 1):
            toks.append(int(torch.multinomial(P[toks[-1]], 1, generator=g)))
        samples.append(odcfn.Sample(torch.tensor(toks)))
    return odcfn.Batch(tuple(samples))


def slow_schedule(steps: int, world: int, fraction: float, seed: int) -> list[int]:
    """``[step] -> rank`` that holds back on that step, -1 for none (the same draw for every τ)."""
    rng = random.Random(seed)
    return [rng.randrange(world) if rng.random() < fraction else -1 for _ in range(steps)]


class _Gate:
    """Forces lags: ``hold(rank, j, target)`` blocks until every other rank has finished step
    ``target``. One rank holds at a time (a second would wait on the first while the first waits
    on it); the timeout only bounds a run on a machine so loaded that the others cannot get there."""

    def __init__(self, world: int, timeout: float) -> None:
        self.done = [-1] * world
        self.holding: int | None = None
        self.timeouts = 0
        self.timeout = timeout
        self.cond = threading.Condition()

    def hold(self, rank: int, target: int) -> None:
        with self.cond:
            if self.holding is not None:
                return
            self.holding = rank
            ok = self.cond.wait_for(
                lambda: all(d >= target for r, d in enumerate(self.done) if r != rank), self.timeout)
            self.timeouts += not ok
            self.holding = None
            self.cond.notify_all()

    def finished(self, rank: int, j: int) -> None:
        with self.cond:
            self.done[rank] = j
            self.cond.notify_all()


def train(
    tau: int, model: Any, full: Any, batches: list[odcfn.Batch], eval_batch: odcfn.Batch,
    slow: list[int], *, lr: odcfn.optim.LR, eval_every: int, world: int = 2, hold_timeout: float = 10.0,
) -> dict[str, Any]:
    """One run at staleness τ. Returns ``eval``: ``[(samples seen, held-out loss)]`` from step 0,
    ``lags``: the largest lag read per step (over ranks), ``timeouts``: forced holds cut short,
    ``record``: what each rank read (``stale.record``; None at τ = 0)."""
    steps = len(batches)
    points = sorted({*range(eval_every, steps, eval_every), steps})  # drained evaluation points
    gate = _Gate(world, hold_timeout)

    def fn(rank: int, tr: Any) -> tuple[list, list]:
        torch.set_num_threads(1)  # W ranks share the cores: no intra-op threads on top
        st = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.adamw(lr, weight_decay=0.0),
                                     transport=tr, config=odcfn.StepConfig(staleness=tau))
        snaps, ms = [], []
        for j, b in enumerate(batches):
            nxt = min(p for p in points if p > j)
            if tau and slow[j] == rank:  # the others may run to j + τ, but not past a drain
                gate.hold(rank, min(j + tau, nxt - 1))
            st, m = odcfn.train_step(st, b)
            ms.append(m)
            gate.finished(rank, j)
            if j + 1 == nxt:  # every rank drains here: params of exactly j + 1 updates
                st, _ = stale.drain(st)
                snaps.append(odcfn.tree_map(lambda t: t.detach().clone(), st.params))
        return snaps, ms

    out = odcfn.run_local(fn, world, timeout=120)
    mesh = odcfn.Mesh(world, 0)
    per_sample = sum(len(b) for b in batches) / steps
    with torch.no_grad():
        evals = [(0, float(reference_loss(model, full, eval_batch)))]
        for i, p in enumerate(points):
            params = odcfn.unshard([o[0][i] for o in out], model, mesh)
            evals.append((round(p * per_sample), float(reference_loss(model, params, eval_batch))))
    lags = [max(int(o[1][j].extra.get("staleness_max", 0)) for o in out) for j in range(steps)]
    rec = stale.record([o[1] for o in out]) if tau else None  # for odcfn.reference.replay
    return {"eval": evals, "lags": lags, "timeouts": gate.timeouts, "record": rec}


def compare(
    taus: tuple[int, ...] = (0, 1, 2), *, steps: int = 60, samples: int = 8, lr: float = 1e-2,
    cosine: bool = False, eval_every: int = 6, world: int = 2, vocab: int = 32, fraction: float = 1 / 3,
    seed: int = 0,
) -> dict[int, dict[str, Any]]:
    """Trains every τ on the same data from the same init; returns ``train``'s result per τ.
    ``cosine``: the learning rate decays from ``lr`` to 0 over the steps, else it stays at ``lr``."""
    cfg = QwenConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    model, full = qwen_model(cfg), init_params(cfg, seed=seed)
    P = chain(vocab, seed)
    rng = random.Random(seed)
    batches = [sample_batch(P, [rng.randint(16, 48) for _ in range(samples)], seed=1000 + seed * 10_000 + j)
               for j in range(steps)]
    eval_batch = sample_batch(P, [48] * 32, seed=seed + 7)  # held out: a seed no minibatch uses
    slow = slow_schedule(steps, world, fraction, seed)
    rate = (lambda k: lr * 0.5 * (1 + math.cos(math.pi * k / steps))) if cosine else lr
    return {t: train(t, model, full, batches, eval_batch, slow, lr=rate, eval_every=eval_every, world=world)
            for t in taus}


def table(res: dict[int, dict[str, Any]]) -> str:
    """Markdown: per τ the final held-out loss, its gap to τ = 0, its excess over the floor, the
    largest gap along the curve (where the loss falls fast, a run a few updates behind is far
    behind), the largest lag read and how many steps read a stale version somewhere."""
    base = res[min(res)]["eval"]
    rows = ["| τ | final held-out loss | vs τ=0 | above the floor | largest gap along the curve "
            "| max lag | steps with lag ≥ 1 |", "|---|---|---|---|---|---|---|"]
    for t, r in res.items():
        ev = r["eval"]
        final, gap = ev[-1][1], ev[-1][1] / base[-1][1] - 1
        worst = max(abs(a[1] / b[1] - 1) for a, b in zip(ev, base))
        stale_steps = sum(x >= 1 for x in r["lags"])
        rows.append(f"| {t} | {final:.4f} | {gap:+.2%} | {final - FLOOR:.4f} | {worst:.2%} "
                    f"| {max(r['lags'])} | {stale_steps}/{len(r['lags'])} |")
    return "\n".join(rows)


def plot(panels: dict[str, dict[int, dict[str, Any]]], path: Path) -> None:
    """One panel per learning-rate schedule: held-out loss vs samples, a line per τ."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.4), sharey=True, squeeze=False)
    for ax, (title, res) in zip(axes[0], panels.items()):
        for t, r in res.items():
            xs, ys = zip(*r["eval"])
            ax.plot(xs, ys, marker="o", ms=3, label=f"τ = {t}" + (" (synchronous)" if t == 0 else ""))
        ax.axhline(FLOOR, color="gray", ls=":", label=f"floor {FLOOR:.3f} (task entropy)")
        ax.set_xlabel("training samples")
        ax.set_title(title, fontsize=9)
    axes[0][0].set_ylabel("held-out loss (nats/token)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150, help="minibatches (optimizer steps)")
    p.add_argument("--samples", type=int, default=8, help="samples per minibatch")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-2, 3e-3],
                   help="AdamW learning rates (no weight decay), one panel each")
    p.add_argument("--cosine", action="store_true", help="decay each lr to 0 over --steps (else constant)")
    p.add_argument("--eval-every", type=int, default=10, help="steps between drained evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/staleness_convergence.png"))
    a = p.parse_args(argv)
    panels = {}
    for lr in a.lrs:
        res = compare(steps=a.steps, samples=a.samples, lr=lr, cosine=a.cosine, eval_every=a.eval_every,
                      seed=a.seed)
        title = f"AdamW lr {lr:g}" + (" cosine" if a.cosine else " constant")
        print(f"\n{title}, {a.steps} steps x {a.samples} samples, 2 ranks, seed {a.seed}\n{table(res)}",
              flush=True)
        for t, r in res.items():
            if r["timeouts"]:
                print(f"τ = {t}: {r['timeouts']} forced holds timed out (machine too loaded to reach τ)")
        panels[title] = res
    plot(panels, a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
