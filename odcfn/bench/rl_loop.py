"""``odcfn bench --only rl-loop``: the RL loop end to end (``odcfn.rl.step`` with ``LocalEngine``)
on W processes; the ranks' runs are in ``odcfn.bench.rl_loop_runs``.

1. One iteration with long-tailed response lengths: ODC+LB-Mini against Collective+LB-Micro on
   the same rollouts; the update phase (``timing_s/update_actor``, target >= 1.10x) and the
   whole iteration (``timing_s/step``), per repeat the slowest rank's time, median and range of
   the per-repeat ratios.
2. Weight sync: ``LocalEngine.update_weights`` against ``gather_params(dst=0)`` + transformers'
   ``load_state_dict``: time, and the peak of live tensor bytes above what was alive before.
3. Async against sync iterations per second on a learning task where generation and update
   take similar time (target >= 1.3x), and both reward curves.
4. The local engine's tokens/s against transformers' ``generate`` (``odcfn.bench.rollout_engine``).

No figure here is asserted: the machine is shared, the section reports what it measured."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

from odcfn.bench.rl_loop_runs import CONTENDERS, LoopSpec

__all__ = ["render", "section", "summarize"]

BASE, ODC = CONTENDERS[0][0], CONTENDERS[1][0]


def _spread(xs: Sequence[float]) -> dict:
    xs = list(xs)
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _iteration(per_rank: list[list[dict]]) -> dict:
    timed = [[x for x in recs if not x["warmup"]] for recs in per_rank]
    repeats = sorted({x["repeat"] for x in timed[0]})

    def rec(rank: int, r: int, who: str) -> dict:
        return next(x for x in timed[rank] if x["repeat"] == r and x["contender"] == who)

    def slowest(r: int, who: str, key: str) -> float:
        return max(rec(k, r, who).get(key, 0.0) for k in range(len(timed)))

    phases = ("gen", "old_log_prob", "update_actor", "weight_sync", "step")
    out: dict = {"by_contender": {}, "ratios": {}}
    for who in (BASE, ODC):
        out["by_contender"][who] = {
            f"timing_s/{p}": _spread([slowest(r, who, f"timing_s/{p}") for r in repeats]) for p in phases}
        out["by_contender"][who]["samples_per_rank_per_update"] = [
            [rec(k, r, who)["samples_per_rank"] for k in range(len(timed))] for r in repeats]
    for p, key in (("update_actor", "update"), ("step", "iteration"), ("gen", "gen")):
        out["ratios"][key] = _spread([slowest(r, BASE, f"timing_s/{p}") / slowest(r, ODC, f"timing_s/{p}")
                                      for r in repeats])
    out["rollouts_identical"] = all(rec(k, r, BASE)["digest"] == rec(k, r, ODC)["digest"]
                                    for k in range(len(timed)) for r in repeats)
    out["response_length"] = [{"mean": rec(0, r, ODC)["response_length/mean"],
                                "max": rec(0, r, ODC)["response_length/max"],
                                "clip_ratio": rec(0, r, ODC)["response_length/clip_ratio"]} for r in repeats]
    return out


def _sync(per_rank: list[dict]) -> dict:
    first = per_rank[0]
    mb = first["model_bytes"]
    out: dict = {"model_bytes": mb, "num_params": first["num_params"], "wall_s": {}, "memory_per_rank": {}}
    for what in ("engine", "gather_load"):
        n = len(first["wall_s"][what])
        out["wall_s"][what] = _spread([max(r["wall_s"][what][i] for r in per_rank) for i in range(n)])
        out["memory_per_rank"][what] = [
            {**r["memory"][what], "live_peak_over_model": r["memory"][what]["live_peak_bytes"] / mb}
            for r in per_rank]
    e, g = out["wall_s"]["engine"]["median"], out["wall_s"]["gather_load"]["median"]
    out["gather_load_over_engine"] = g / e if e else None
    return out


def _async(per_rank: list[list[dict]]) -> dict:
    runs = sorted({x["run"] for x in per_rank[0]})

    def get(run: int, mode: str) -> list[dict]:
        return [next(x for x in recs if x["run"] == run and x["mode"] == mode) for recs in per_rank]

    out: dict = {"by_mode": {}}
    for mode in ("sync", "async"):
        xs = [get(i, mode) for i in runs]
        iters = len(xs[0][0]["scores"])
        curves = [x[0]["scores"] for x in xs]  # every rank computes the same scores
        mean_curve = [_mean([c[i] for c in curves]) for i in range(iters)]
        k = min(5, iters)
        out["by_mode"][mode] = {
            "iters_per_s": _spread([iters / max(r["wall_s"] for r in x) for x in xs]),
            # CPU seconds per wall second of a rank (1 = a core to itself; 2 ranks on 2 cores: <= 1)
            "cpu_share": _spread([_mean([r["cpu_s"] / r["wall_s"] for r in x]) for x in xs]),
            "cpu_s_per_iter": _spread([_mean([r["cpu_s"] for r in x]) / iters for x in xs]),
            "reward_curve": mean_curve, "reward_mean": _mean(mean_curve),
            "reward_first5": _mean(mean_curve[:k]), "reward_last5": _mean(mean_curve[-k:]),
            "timing_mean_s": {key: _mean([r["timing_mean_s"][key] for x in xs for r in x])
                              for key in xs[0][0]["timing_mean_s"]},
        }
    ratio = [(len(get(i, "async")[0]["scores"]) / max(r["wall_s"] for r in get(i, "async")))
             / (len(get(i, "sync")[0]["scores"]) / max(r["wall_s"] for r in get(i, "sync"))) for i in runs]
    out["async_over_sync"] = _spread(ratio)
    out["overlap_bound"] = _overlap_bound(runs, get)
    t = out["by_mode"]["sync"]["timing_mean_s"]
    train = sum(t.get(f"timing_s/{p}", 0.0) for p in ("old_log_prob", "update_actor", "weight_sync"))
    out["sync_gen_over_train"] = t["timing_s/gen"] / train if train else None
    return out


def _overlap_bound(runs: list[int], get) -> dict | None:
    """What overlap can give on these cores, per run pair, from the sync run's loop thread and
    the async run's process CPU time: with one core per rank and no other load, a sync
    iteration takes its thread's CPU time plus the time it slept (waiting for a peer: the only
    idle time of the rank's core), and an async one at least the process's CPU time (both
    threads' work on that one core). So ``(run + slept)_sync / cpu_async`` bounds async/sync
    there; wait for a CPU (``runqueue``: other jobs) is left out of both."""
    if any(r.get("main_thread") is None for i in runs for m in ("sync", "async") for r in get(i, m)):
        return None
    bound, idle = [], []
    for i in runs:
        s, a = [r["main_thread"] for r in get(i, "sync")], get(i, "async")
        bound.append(max(t["run_s"] + t["slept_s"] for t in s) / max(r["cpu_s"] for r in a))
        idle.append(_mean([t["slept_s"] / (t["run_s"] + t["slept_s"]) for t in s]))
    queued = {m: _spread([_mean([r["main_thread"]["runqueue_s"] / r["wall_s"] for r in get(i, m)])
                          for i in runs]) for m in ("sync", "async")}
    return {"async_over_sync_one_core_per_rank": _spread(bound), "sync_idle_share": _spread(idle),
            "runqueue_share": queued}


def summarize(per_rank: list[dict]) -> dict:
    """The launched ranks' records -> the section's figures (pure; the tests call it by hand)."""
    it = _iteration([r["iteration"] for r in per_rank])
    sy = _sync([r["sync"] for r in per_rank])
    asy = _async([r["async"] for r in per_rank])
    ratios = {"update_odc_lb_mini_over_collective_lb_micro": it["ratios"]["update"]["median"],
              "iteration_odc_lb_mini_over_collective_lb_micro": it["ratios"]["iteration"]["median"],
              "async_over_sync_iters_per_s": asy["async_over_sync"]["median"],
              "sync_gather_load_over_engine_time": sy["gather_load_over_engine"]}
    return {"iteration": it, "sync": sy, "async": asy, "ratios": ratios}


def section(ctx, quick: bool = False, shape: str | None = None) -> dict:
    """Launch the W ranks once (every part inside that job), then the engine's tokens/s here."""
    if ctx.backend != "process":
        return {"skipped": "the RL loop over ShmTransport needs real processes (odcfn.launch)"}
    from odcfn.bench.rl_loop_runs import loop_worker
    from odcfn.bench.rollout_engine import bench_rollout_engine
    from odcfn.launch import launch

    shape = shape or ("quick" if quick else "full")
    spec = LoopSpec.shape(shape, ctx.workload.world_size)
    load0 = list(os.getloadavg())
    ctx.log(f"   {spec.world_size} processes, shape {shape}: {spec.prompts} prompts x {spec.group_size}, "
            f"max_tokens {spec.max_tokens}, stop tokens 1/{spec.stop_every} of the vocabulary, "
            f"{spec.repeats} repeats")
    per_rank = launch(loop_worker, spec.world_size, args=(spec, ctx.progress), timeout=spec.timeout * 10)
    res = summarize(per_rank)
    ctx.log("   the local engine's tokens/s against transformers' generate")
    engine_args = {"full": {}, "quick": dict(prompts=16, new_tokens=32, d_model=128, n_layers=2, repeats=2),
                   "tiny": dict(prompts=2, prompt_len=4, new_tokens=4, d_model=32, n_layers=1, vocab_size=64,
                                repeats=1)}[shape]
    res["engine_tokens_per_s"] = bench_rollout_engine(threads=1, **engine_args)
    for mode in ("greedy", "sample", "stop"):
        res["ratios"][f"engine_over_hf_tokens_per_s_{mode}"] = res["engine_tokens_per_s"][f"ratio_{mode}"]
    cfg, sync_cfg = spec.cfg, spec.sync_cfg
    res["config"] = {**vars(spec), "model": vars(cfg) | {"num_params": cfg.num_params},
                     "sync_model": vars(sync_cfg) | {"num_params": sync_cfg.num_params},
                     "max_tokens_per_microbatch": spec.max_tokens_per_microbatch, "shape": shape,
                     "contenders": [c[0] for c in CONTENDERS],
                     "loss": "policy_gradient(clip_ratio_high=0.28) (async: decoupled=True)"}
    res["load_average"] = {"start": load0, "end": list(os.getloadavg())}
    return res


def _fmt(s: dict, unit: str = "x") -> str:
    if not s or s.get("median") is None:
        return "-"
    return f"{s['median']:.3f}{unit} [{s['min']:.3f}-{s['max']:.3f}]"


def render(sec: dict | None) -> str:
    """The section for humans (empty when it did not run)."""
    if not sec:
        return ""
    if "iteration" not in sec:
        return f"\n\n11. RL loop: {sec.get('skipped') or sec.get('error')}"
    it, sy, asy, c = sec["iteration"], sec["sync"], sec["async"], sec["config"]
    lines = ["", "", f"11. RL loop (odcfn.rl.step + LocalEngine, {c['world_size']} processes, shape "
             f"{c['shape']}; median [range] over repeats; load average {sec['load_average']['start'][0]:.1f} "
             f"at start, {sec['load_average']['end'][0]:.1f} at end)"]
    lengths = [r["mean"] for r in it["response_length"]]
    lines.append(f"   one iteration, {c['prompts']} prompts x {c['group_size']}, response lengths mean "
                 f"{_mean(lengths):.0f} (max {max(r['max'] for r in it['response_length']):.0f} of "
                 f"{c['max_tokens']}); rollouts identical across contenders: {it['rollouts_identical']}")
    for who, d in it["by_contender"].items():
        lines.append(f"     {who:<20} update {_fmt(d['timing_s/update_actor'], ' s')}  "
                     f"iteration {_fmt(d['timing_s/step'], ' s')}  gen {_fmt(d['timing_s/gen'], ' s')}")
    lines.append(f"     ODC+LB-Mini / Collective+LB-Micro: update {_fmt(it['ratios']['update'])} "
                 f"(target 1.10), iteration {_fmt(it['ratios']['iteration'])}")
    mem = sy["memory_per_rank"]
    lines.append(f"   weight sync ({sy['num_params'] / 1e6:.1f}M params, "
                 f"{sy['model_bytes'] / 2**20:.1f} MiB): engine {_fmt(sy['wall_s']['engine'], ' s')}, "
                 f"gather_params(dst=0) + load_state_dict {_fmt(sy['wall_s']['gather_load'], ' s')}")
    for what, label in (("engine", "engine.update_weights"), ("gather_load", "gather + load_state_dict")):
        per = ", ".join(f"rank {k}: {m['live_peak_over_model']:.2f}" for k, m in enumerate(mem[what]))
        lines.append(f"     {label}: peak live tensor bytes above before / model bytes: {per}")
    s, a = asy["by_mode"]["sync"], asy["by_mode"]["async"]
    lines.append(f"   async vs sync (gen / train time in sync: {asy['sync_gen_over_train']:.2f}): "
                 f"iterations/s {_fmt(a['iters_per_s'], '')} vs {_fmt(s['iters_per_s'], '')}, ratio "
                 f"{_fmt(asy['async_over_sync'])} (target 1.3); CPU share per rank "
                 f"{a['cpu_share']['median']:.2f} vs {s['cpu_share']['median']:.2f}")
    b = asy.get("overlap_bound")
    if b:
        lines.append(f"     bound with one core per rank and no other load: async/sync <= "
                     f"{_fmt(b['async_over_sync_one_core_per_rank'])} (sync loop thread idle "
                     f"{_fmt(b['sync_idle_share'], '')} of its busy time; waiting for a CPU: "
                     f"{b['runqueue_share']['sync']['median']:.2f} sync, "
                     f"{b['runqueue_share']['async']['median']:.2f} async of the wall time)")
    lines.append(f"     reward mean {a['reward_mean']:.3f} async vs {s['reward_mean']:.3f} sync (first 5 "
                 f"{a['reward_first5']:.3f} / {s['reward_first5']:.3f}, last 5 {a['reward_last5']:.3f} / "
                 f"{s['reward_last5']:.3f})")
    e = sec["engine_tokens_per_s"]
    lines.append("   local engine / transformers' generate, tokens/s (wall; CPU time): " + ", ".join(
        f"{m} {e[f'ratio_{m}']:.2f}x ({e[f'ratio_cpu_{m}']:.2f}x)" for m in ("greedy", "sample", "stop")))
    return "\n".join(lines)
