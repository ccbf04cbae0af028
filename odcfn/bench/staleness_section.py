"""``odcfn bench --only staleness``: synchronous ODC + LB-Mini against bounded staleness τ = 1, 2
over W processes, on long-tail data (a), with a noisy neighbour (b), on equal lengths (c): the
runs (``odcfn.bench.staleness_runs``), their summary and their table.

Per variant and τ: samples/s (median and range over the repeats), its ratio to τ = 0 per repeat
(runs of one repeat and variant are adjacent, so the ratio pairs runs under similar load), the
waiting per rank (for versions at τ >= 1, at the one sync at τ = 0, and in ``drain``), the
largest lag read, and the held-out loss after the same samples (drained params)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from odcfn.bench.staleness_runs import StaleSpec

__all__ = ["LABELS", "render", "section", "summarize"]

LABELS = {"long_tail": "(a) long-tail lengths", "noisy": "(b) long-tail + a noisy neighbour",
          "equal": "(c) equal lengths"}


def _spread(xs: Sequence[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _bound(x: list[dict]) -> float:
    """From one synchronous run's per-rank step times: the sum over minibatches of the slowest
    rank's step time over the largest per-rank sum of busy time (step time less the wait at the
    sync): what hiding every imbalance, as τ = ∞ with free versions would, could give."""
    n = len(x[0]["steps"])
    total = sum(max(r["steps"][j]["wall"] for r in x) for j in range(n))
    return total / max(sum(s["wall"] - s["sync_s"] for s in r["steps"]) for r in x)


def summarize(per_rank: list[dict], spec: StaleSpec) -> dict:
    """The launched ranks' runs -> ``{variant: {str(τ): figures}}`` plus the headline ratios."""
    w = spec.workload
    samples = spec.steps * w.samples_per_step
    runs: dict[tuple[str, int, int], list[dict]] = {}  # (variant, τ, repeat) -> per-rank runs
    for rank in per_rank:
        for r in rank["runs"]:
            runs.setdefault((r["variant"], r["tau"], r["repeat"]), []).append(r)
    rate = {k: samples / max(r["elapsed"] for r in rs) for k, rs in runs.items()}  # slowest rank's clock
    # samples per CPU-second of a rank: the work's own cost, whatever share of the cores the
    # scheduler gave each run (waiting costs no CPU, so this cannot show what hiding waits buys)
    per_cpu = {k: samples / _mean([r["cpu_s"] for r in rs]) for k, rs in runs.items()}
    out: dict = {}
    for v in spec.variants:
        out[v] = {}
        for t in spec.taus:
            keys = [(v, t, i) for i in range(spec.repeats)]
            rs = [runs[k] for k in keys]
            evals = [x[0]["eval_loss"] for x in rs]
            last = [_mean([loss for loss in x[0]["train_losses"][-2:] if loss is not None]) for x in rs]
            out[v][str(t)] = {
                "samples_per_s": _spread([rate[k] for k in keys]),
                "over_tau0": _spread([rate[k] / rate[(v, 0, k[2])] for k in keys]),
                "per_cpu_s_over_tau0": _spread([per_cpu[k] / per_cpu[(v, 0, k[2])] for k in keys]),
                # per rank: the sum over the timed minibatches, averaged over ranks; median over repeats
                "version_wait_s": statistics.median(_mean([sum(s["version_wait_s"] for s in r["steps"])
                                                           for r in x]) for x in rs),
                "sync_s": statistics.median(_mean([sum(s["sync_s"] for s in r["steps"]) for r in x])
                                            for x in rs),
                "drain_s": statistics.median(_mean([r["drain_s"] for r in x]) for x in rs),
                # CPU seconds per wall second of a rank (1 = a core to itself): below 1 other jobs
                # took the cores, and a τ that runs while another waits gets more of them
                "cpu_share": statistics.median(_mean([r["cpu_s"] / r["elapsed"] for r in x]) for x in rs),
                "max_lag": max(s["lag"] for x in rs for r in x for s in r["steps"]),
                "syncs_per_minibatch": max(s["syncs"] for x in rs for r in x for s in r["steps"]),
                "eval_loss": _spread(evals),
                # every rank computed the same held-out loss (one sync sums their shares)
                "eval_loss_ranks_agree": all(abs(r["eval_loss"] - x[0]["eval_loss"]) <= 1e-6 * abs(
                    r["eval_loss"]) for x in rs for r in x),
                "train_loss_last2": _spread(last),
                "elapsed_s": [max(r["elapsed"] for r in x) for x in rs],
                # per repeat, per rank: each timed minibatch's step time (s)
                "step_time_s": [[[round(s["wall"], 4) for s in r["steps"]] for r in x] for x in rs],
                "slow_steps_per_rank": [sum(s["slow"] for s in r["steps"]) for r in rs[0]],
            }
    bound = {v: _spread([_bound(runs[(v, 0, i)]) for i in range(spec.repeats)]) for v in spec.variants}
    ratios = {f"staleness_{v}_tau{t}_over_tau0": out[v][str(t)]["over_tau0"]["median"]
              for v in spec.variants for t in spec.taus if t}
    return {"by_variant": out, "bound_over_tau0": bound, "ratios": ratios}


def section(ctx, quick: bool = False) -> dict:
    """Launch the W ranks once; every run of every variant and τ happens inside that job."""
    if ctx.backend != "process":
        return {"skipped": "bounded staleness over ShmTransport needs real processes (odcfn.launch)"}
    from odcfn.bench.staleness_runs import run_order, stale_worker
    from odcfn.launch import launch

    spec = StaleSpec(ctx.workload, steps=ctx.steps, repeats=2 if quick else 3, cost=ctx.cost)
    w = spec.workload
    ctx.log(f"   {w.world_size} processes, ODC + LB-Mini, τ {list(spec.taus)}, {spec.steps} timed "
            f"minibatches of {w.samples_per_step} samples per run, {len(run_order(spec))} runs "
            f"({spec.repeats} repeats, interleaved); noisy neighbour: {spec.factor:g}x on "
            f"{spec.fraction:.2f} of the minibatches")
    per_rank = launch(stale_worker, w.world_size, args=(spec, ctx.progress), timeout=spec.timeout * 10)
    res = summarize(per_rank, spec)
    return {
        "config": {"world_size": w.world_size, "taus": list(spec.taus), "variants": list(spec.variants),
                   "steps": spec.steps, "samples_per_step": w.samples_per_step, "repeats": spec.repeats,
                   "factor": spec.factor, "fraction": spec.fraction, "balance": "lb_mini", "optimizer":
                   f"adamw({w.lr:g})", "tokens": "Zipf(1.1) ids, LongAlign-like lengths / "
                   f"{w.length_scale}", "model": vars(w.model) | {"num_params": w.model.num_params}},
        "noisy_rank_per_minibatch": per_rank[0]["noisy"],  # minibatch 0 is the untimed one
        "eval_loss_init": per_rank[0]["eval_loss_init"],
        "loss": "token cross-entropy of the drained params on one held-out minibatch (same lengths "
                "law, same token law), every τ after the same samples in the same order",
        **res,
    }


def render(sec: dict | None) -> str:
    """The section for humans (empty when it did not run)."""
    from odcfn.bench.report import table

    if not sec:
        return ""
    if "by_variant" not in sec:
        return f"\n\n10. bounded staleness: {sec.get('skipped') or sec.get('error')}"
    c = sec["config"]
    lines = ["", "", f"10. bounded staleness: ODC + LB-Mini at τ {c['taus']} ({c['world_size']} processes, "
             f"{c['steps']} timed minibatches of {c['samples_per_step']} samples per run, {c['repeats']} "
             f"repeats interleaved; held-out loss at init {sec['eval_loss_init']:.4f})"]
    for v, by_tau in sec["by_variant"].items():
        rows = []
        for t, f in by_tau.items():
            s, o, e = f["samples_per_s"], f["over_tau0"], f["eval_loss"]
            rows.append([t, f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})",
                         f"{o['median']:.3f}x ({o['min']:.3f}-{o['max']:.3f})",
                         f["version_wait_s"] if t != "0" else f["sync_s"], f["drain_s"], f["max_lag"],
                         f["cpu_share"], f"{f['per_cpu_s_over_tau0']['median']:.3f}x",
                         f"{e['median']:.4f} ({e['min']:.4f}-{e['max']:.4f})"])
        b = sec["bound_over_tau0"][v]
        lines += [f"   {LABELS[v]}; all imbalance hidden (bound from τ=0's busy times): {b['median']:.3f}x "
                  f"({b['min']:.3f}-{b['max']:.3f})",
                  table(rows, ["τ", "samples/s (median, range)", "vs τ=0 (median, range)",
                               "wait/rank s (τ=0: sync)", "drain s", "max lag", "cpu share",
                               "per CPU-s vs τ=0",
                               "held-out loss"])]
    return "\n".join(lines)

