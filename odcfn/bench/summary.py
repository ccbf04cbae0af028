"""What ``odcfn bench`` makes of its sections' raw figures: ``fill_ratios`` derives the headline
ratios (and checks them against ``TARGETS``), ``render`` prints the report for humans."""

from __future__ import annotations

from odcfn.bench.report import paired_median_speedup, ratio, shared_cores_warning, table
from odcfn.bench.workload import SAME_WIRE

__all__ = ["TARGETS", "fill_ratios", "render"]


# --- ratios -------------------------------------------------------------------------------


def _sps(section: dict | None, policy: str) -> float | None:
    try:
        return section["policies"][policy]["samples_per_s"]
    except (KeyError, TypeError):
        return None


def fill_ratios(report: dict) -> None:
    r, cfg = report["ratios"], report["config"]
    e2e = report.get("end_to_end", {}).get("by_samples_per_rank", {})
    head = e2e.get(str(cfg["headline_samples_per_rank"]))
    base = _sps(head, "collective+lb-micro")
    r["odc_lb_mini_over_collective_lb_micro"] = ratio(_sps(head, "odc+lb-mini"), base)
    r["odc_work_stealing_over_collective_lb_micro"] = ratio(_sps(head, "odc+work-stealing"), base)
    r["odc_work_stealing_over_odc_lb_mini"] = ratio(_sps(head, "odc+work-stealing"),
                                                    _sps(head, "odc+lb-mini"))
    r["odc_lb_mini_over_collective_lb_micro_by_samples_per_rank"] = {
        k: ratio(_sps(v, "odc+lb-mini"), _sps(v, "collective+lb-micro")) for k, v in e2e.items()
    }
    # the same-wire baseline: ODC against it differs in synchronisation (and balancing) only
    same = _sps(head, SAME_WIRE)
    r["odc_lb_mini_over_collective_shm_lb_micro"] = ratio(_sps(head, "odc+lb-mini"), same)
    r["collective_shm_over_collective_gloo"] = ratio(same, base)
    r["odc_lb_mini_over_collective_shm_lb_micro_by_samples_per_rank"] = {
        k: ratio(_sps(v, "odc+lb-mini"), _sps(v, SAME_WIRE)) for k, v in e2e.items()
    }
    bal = report.get("balanced")
    r["balanced_odc_over_collective"] = ratio(_sps(bal, "odc+lb-mini"), _sps(bal, "collective+lb-micro"))
    r["balanced_odc_over_collective_shm"] = ratio(_sps(bal, "odc+lb-mini"), _sps(bal, SAME_WIRE))
    r["balanced_collective_shm_over_collective_gloo"] = ratio(_sps(bal, SAME_WIRE),
                                                              _sps(bal, "collective+lb-micro"))
    f = report.get("fsdp2") or {}
    fsdp2_sps = f.get("torch_fsdp2", {}).get("samples_per_s")
    r["collective_over_torch_fsdp2"] = ratio(f.get("odcfn_collective", {}).get("samples_per_s"), fsdp2_sps)
    r["odc_lb_mini_over_torch_fsdp2"] = ratio(f.get("odc_lb_mini", {}).get("samples_per_s"), fsdp2_sps)
    p = report.get("primitives") or {}
    if "gbps" in p:
        sizes, g = p["sizes_mib"], p["gbps"]
        i = sizes.index(16) if 16 in sizes else len(sizes) - 1
        r["primitives_at_mib"] = sizes[i]
        r["shm_gather_over_gloo_all_gather"] = ratio(g["shm_gather"][i], g["gloo_all_gather"][i])
        r["shm_gather_over_memcpy"] = ratio(g["shm_gather"][i], g["memcpy"][i])
        r["shm_scatter_accumulate_over_gloo_reduce_scatter"] = ratio(
            g["shm_scatter_accumulate"][i], g["gloo_reduce_scatter"][i])
        r["shm_scatter_accumulate_over_local_add"] = ratio(g["shm_scatter_accumulate"][i],
                                                           g["local_add"][i])
    else:
        r["shm_gather_over_gloo_all_gather"] = r["shm_gather_over_memcpy"] = None
    rl = report.get("rl")
    rb = _sps(rl, "collective+lb-micro")
    r["rl_odc_lb_mini_over_collective_lb_micro"] = ratio(_sps(rl, "odc+lb-mini"), rb)
    r["rl_odc_lb_micro_over_collective_lb_micro"] = ratio(_sps(rl, "odc+lb-micro"), rb)
    r["rl_odc_lb_mini_over_odc_lb_micro"] = ratio(_sps(rl, "odc+lb-mini"), _sps(rl, "odc+lb-micro"))
    r["rl_log_probs_over_train_step"] = ((rl or {}).get("log_probs") or {}).get("log_probs_over_train_step")
    pref = report.get("preference")
    # the median over the section's repeated side-by-side runs (their range is in the section)
    r["preference_odc_lb_mini_over_collective_lb_micro"] = (
        ((pref or {}).get("odc_lb_mini_over_collective_lb_micro") or {}).get("median"))
    s = report.get("simulator") or {}
    r["simulated_over_measured_step_time"] = s.get("simulated_over_measured_step_time")
    st = report.get("straggler")
    sb = _sps(st, "collective+lb-micro")
    r["straggler_odc_lb_mini_over_collective_lb_micro"] = ratio(_sps(st, "odc+lb-mini"), sb)
    r["straggler_odc_work_stealing_over_collective_lb_micro"] = ratio(
        _sps(st, "odc+work-stealing"), sb)
    r["straggler_odc_lb_mini_over_collective_shm_lb_micro"] = ratio(_sps(st, "odc+lb-mini"),
                                                                     _sps(st, SAME_WIRE))
    r["straggler_odc_work_stealing_over_odc_lb_mini"] = ratio(_sps(st, "odc+work-stealing"),
                                                             _sps(st, "odc+lb-mini"))

    def paired(sec, a, b="collective+lb-micro"):
        try:
            return paired_median_speedup(sec["policies"][a], sec["policies"][b])
        except (KeyError, TypeError):
            return None

    r["paired_median"] = {
        "odc_lb_mini_over_collective_lb_micro": paired(head, "odc+lb-mini"),
        "odc_lb_mini_over_collective_shm_lb_micro": paired(head, "odc+lb-mini", SAME_WIRE),
        "collective_shm_over_collective_gloo": paired(head, SAME_WIRE),
        "odc_work_stealing_over_odc_lb_mini": paired(head, "odc+work-stealing", "odc+lb-mini"),
        "balanced_odc_over_collective_shm": paired(bal, "odc+lb-mini", SAME_WIRE),
        "straggler_odc_work_stealing_over_odc_lb_mini": paired(st, "odc+work-stealing", "odc+lb-mini"),
        "odc_work_stealing_over_collective_lb_micro": paired(head, "odc+work-stealing"),
        "balanced_odc_over_collective": paired(bal, "odc+lb-mini"),
        "straggler_odc_lb_mini_over_collective_lb_micro": paired(st, "odc+lb-mini"),
        "straggler_odc_work_stealing_over_collective_lb_micro": paired(st, "odc+work-stealing"),
        "rl_odc_lb_mini_over_collective_lb_micro": paired(rl, "odc+lb-mini"),
        "collective_over_torch_fsdp2": (
            paired_median_speedup(f["odcfn_collective"], f["torch_fsdp2"])
            if "torch_fsdp2" in f else None),
        "odc_lb_mini_over_torch_fsdp2": (
            paired_median_speedup(f["odc_lb_mini"], f["torch_fsdp2"]) if "odc_lb_mini" in f else None),
    }
    moe = (report.get("moe") or {})
    if "vs_fsdp2" in moe:  # the MoE section's three headline figures (medians over repeats)
        r["moe_odc_lb_mini_over_torch_fsdp2"] = moe["vs_fsdp2"]["samples_per_s_odc_over_fsdp2"]
        r["moe_peak_memory_odc_over_torch_fsdp2"] = moe["memory"]["odc_over_fsdp2"]["median"]
        r["moe_expert_compute_transformers_over_odcfn"] = (
            moe["expert_compute"]["transformers_over_odcfn"]["odcfn_routed_ffn"]["median"])
    # the staleness section's medians over its repeats of τ / τ = 0 per variant (ranges in the section)
    r.update(((report.get("staleness") or {}).get("ratios")) or {})
    for comm in ("odc", "collective"):
        vals = [
            pol["syncs_per_minibatch"]
            for sec in [*e2e.values(), bal, st, rl, pref] if isinstance(sec, dict) and "policies" in sec
            for pol in sec["policies"].values() if pol["comm"] == comm
        ]
        report["syncs_per_minibatch"][comm] = max(vals) if vals else None
    flags = [sec.get("losses_match") for sec in [*e2e.values(), bal, st, f, rl, moe.get("vs_fsdp2"), pref]
             if isinstance(sec, dict) and "losses_match" in sec]
    report["losses_match"] = all(flags) if flags else None
    report["targets"] = _targets(r)
    sums = [pol for sec in [*e2e.values(), bal, st, rl, pref] if isinstance(sec, dict) and "policies" in sec
            for pol in sec["policies"].values()]
    shares = [p["core_share"] for p in sums if p.get("core_share") is not None]
    report["core_share_min"] = min(shares) if shares else None
    warn = shared_cores_warning(sums)
    if warn:
        report["notes"].append(warn)


# (ratio key, target, higher is better)
TARGETS = (
    ("odc_lb_mini_over_collective_lb_micro", 1.07, True),
    ("odc_work_stealing_over_collective_lb_micro", 1.07, True),
    ("odc_work_stealing_over_odc_lb_mini", 0.98, True),  # stealing costs ~nothing when nobody is slow
    ("balanced_odc_over_collective", 0.97, True),
    ("collective_over_torch_fsdp2", 0.9, True),
    ("shm_gather_over_gloo_all_gather", 3.0, True),
    ("shm_gather_over_memcpy", 0.5, True),
    ("straggler_odc_work_stealing_over_collective_lb_micro", 1.15, True),
    ("rl_odc_lb_mini_over_collective_lb_micro", 1.10, True),
    ("rl_log_probs_over_train_step", 0.45, False),
    ("preference_odc_lb_mini_over_collective_lb_micro", 1.10, True),
    ("moe_odc_lb_mini_over_torch_fsdp2", 1.15, True),
    ("moe_peak_memory_odc_over_torch_fsdp2", 0.7, False),
    ("moe_expert_compute_transformers_over_odcfn", 1.0, True),
    ("staleness_noisy_tau1_over_tau0", 1.15, True),  # a moving noisy neighbour, hidden at τ = 1
    ("staleness_equal_tau1_over_tau0", 0.98, True),  # nothing to hide: what the versions cost
)


def _targets(r: dict) -> dict:
    out = {}
    for key, target, higher in TARGETS:
        v = r.get(key)
        out[key] = {"target": target, "measured": v,
                    "met": None if v is None else (v >= target if higher else v <= target)}
    v = r.get("simulated_over_measured_step_time")
    out["simulated_over_measured_step_time"] = {
        "target": "within 15% (0.85-1.15)", "measured": v,
        "met": None if v is None else 0.85 <= v <= 1.15}
    return out


# --- human output -------------------------------------------------------------------------


def _policy_rows(sec: dict) -> list[list]:
    base, same = _sps(sec, "collective+lb-micro"), _sps(sec, SAME_WIRE)
    return [[name, p["balancer"], p["samples_per_s"], p["tokens_per_s"], p["bubble_rate"],
             ratio(p["samples_per_s"], base), ratio(p["samples_per_s"], same)]
            for name, p in sec["policies"].items()]


_HDR = ["policy", "balancer", "samples/s", "tokens/s", "bubble", "x gloo collective", "x shm collective"]


def _where_from(report: dict) -> list[str]:
    """The headline split into its two effects, in words."""
    r = report["ratios"]
    total, wire = r.get("odc_lb_mini_over_collective_lb_micro"), r.get("collective_shm_over_collective_gloo")
    sync, bal = r.get("odc_lb_mini_over_collective_shm_lb_micro"), r.get("balanced_odc_over_collective_shm")
    if total is None or sync is None:
        return []
    out = ["", "where ODC+LB-Mini's gain over Collective+LB-Micro (gloo) comes from "
               f"({report['config']['headline_samples_per_rank']} samples per rank):",
           f"  total, what a user sees against collectives over gloo:     {_f(total)}x",
           f"  the wire: collectives over shared memory instead of gloo:  {_f(wire)}x",
           f"  synchronisation + balancing: ODC vs the same-wire baseline: {_f(sync)}x (long-tail data)"]
    if bal is not None:
        out.append(f"  the same on equal-length data (no imbalance to remove):    {_f(bal)}x")
    fs = r.get("odc_lb_mini_over_torch_fsdp2")
    if fs is not None:
        out.append(f"  ODC+LB-Mini vs torch FSDP2 + LB-Micro (section 3):         {_f(fs)}x")
    return out


def render(report: dict) -> str:
    out = [f"odcfn bench ({report['config']['backend']} backend, W={report['config']['world_size']}"
           f", {report['config']['steps']} timed minibatches per policy)"]
    for k, sec in report.get("end_to_end", {}).get("by_samples_per_rank", {}).items():
        out += ["", f"1. end to end, long-tail data, {k} samples per rank "
                    f"(losses match: {sec['losses_match']})", table(_policy_rows(sec), _HDR)]
    for title, key in (("2. balanced data (all samples equal length)", "balanced"),
                       ("6. straggler: one rank emulates a 1.5x slower device", "straggler"),
                       ("7. RL: GRPO updates on AIME-RL-like rollouts (policy_gradient)", "rl")):
        sec = report.get(key) or {}
        if "policies" in sec:
            out += ["", title, table(_policy_rows(sec), _HDR)]
            if key == "straggler":
                out.append("   " + sec["emulation"])
            if key == "rl":
                lp, ln = sec["log_probs"], sec["lengths"]
                out.append(f"   lengths: mean {ln['mean']:.0f}, max {ln['max']} tokens (AIME / "
                           f"{ln['length_scale']}), groups of {ln['group_size']}; log_probs costs "
                           f"{lp['log_probs_over_train_step']:.2f}x a train_step")
                rows = [[x["devices"], x["samples_per_device"], x["odc+lb-micro"], x["odc+lb-mini"]]
                        for x in sec["simulated"]]
                out += ["   simulator (7B, full AIME-RL lengths), samples/s over collective+lb-micro:",
                        table(rows, ["devices", "samples/device", "odc+lb-micro x", "odc+lb-mini x"])]
        elif sec:
            out += ["", f"{title}: {sec.get('skipped') or sec.get('error')}"]
    f = report.get("fsdp2") or {}
    if "torch_fsdp2" in f:
        names = {"odcfn": "odcfn collective+lb-micro (gloo)", "fsdp2": "torch FSDP2 + lb-micro",
                 "odc": "odcfn odc+lb-mini"}
        fs = f["torch_fsdp2"]["samples_per_s"]
        rows = [[names[v["impl"]], v["samples_per_s"], v["tokens_per_s"], ratio(v["samples_per_s"], fs)]
                for v in (f["odcfn_collective"], f["torch_fsdp2"], f.get("odc_lb_mini")) if v]
        out += ["", f"3. torch FSDP2 vs odcfn, same minibatches (losses match: {f['losses_match']})",
                table(rows, ["impl", "samples/s", "tokens/s", "x torch FSDP2"])]
    elif f:
        out += ["", f"3. torch FSDP2: {f.get('skipped') or f.get('error')}"]
    rc = report.get("recovery") or {}
    if "recovery" in rc:
        b = rc["blocked_per_save_s"]
        out += ["", f"8. saving and recovery ({rc['checkpoint_bytes_per_rank']} bytes per rank file)",
                f"   blocked per save: blocking {b['blocking']:.4f}s, async {b['async']:.4f}s "
                f"({rc['async_over_blocking']:.3f}x); step {rc['step_s']:.3f}s",
                f"   memory-tier snapshot every step: step-time overhead "
                f"{100 * rc['memory_tier_every_step']['overhead']:.1f}%; deterministic accumulation: "
                f"{100 * rc['deterministic_step_overhead']:.1f}%"]
        rows = [[r["tier"], r["killed_after_step"], r["resumed_at_step"], r["lost_steps"],
                 r["kill_to_next_step_s"], r["kill_to_progress_s"], *r["breakdown_s"].values()]
                for r in rc["recovery"]]
        hdr = ["tier", "killed after", "resumed at", "lost steps", "kill->step s", "->past s"]
        out.append(table(rows, [*hdr, *rc["recovery"][0]["breakdown_s"]]))
        out += [f"   {r['tier']}: read {r['fetch']['bytes'] / 2**20:.1f} MiB back from node(s) "
                f"{r['fetch']['from_nodes']} in {r['fetch']['seconds']:.3f}s"
                for r in rc["recovery"] if "fetch" in r]
    elif rc:
        out += ["", f"8. saving and recovery: {rc.get('error')}"]
    p = report.get("primitives") or {}
    if "gbps" in p:
        rows = [[name, *vals] for name, vals in p["gbps"].items()]
        out += ["", "4. primitives, GB/s (" + p["definition"] + ")",
                table(rows, ["primitive", *[f"{s} MiB" for s in p["sizes_mib"]]])]
    elif p:
        out += ["", f"4. primitives: {p.get('skipped') or p.get('error')}"]
    s = report.get("simulator") or {}
    if "rows" in s:
        out += ["", "5. simulator vs measured step time (trace makespan)",
                table(s["rows"], s["columns"])]
        if "straggler" in s:
            out += ["   with the 1.5x straggler:", table(s["straggler"]["rows"], s["columns"])]
    elif s:
        out += ["", f"5. simulator: {s.get('skipped') or s.get('error')}"]
    if "extrapolation" in s:
        rows = [[x["devices"], x["samples_per_device"], x["collective+lb-micro"]["samples_per_s"],
                 x["odc+lb-mini"]["over_collective_lb_micro"],
                 x["odc+work-stealing"]["over_collective_lb_micro"]] for x in s["extrapolation"]]
        out += ["", "   simulator extrapolation (same model and data per device, comm as above)",
                table(rows, ["devices", "samples/device", "collective samples/s",
                             "odc+lb-mini x", "odc+work-stealing x"])]
    out += _where_from(report)
    out += ["", "ratios (higher = first one faster; simulated/measured: 1 = exact)"]
    for k, v in report["ratios"].items():
        if isinstance(v, dict):
            out.append(f"  {k}:")
            out += [f"    {k2}: {_f(v2)}" for k2, v2 in v.items()]
        else:
            out.append(f"  {k}: {_f(v)}")
    out += ["", "targets"]
    out += [f"  {k}: measured {_f(t['measured'])} vs target {t['target']}: "
            f"{'met' if t['met'] else 'MISSED' if t['met'] is False else 'not measured'}"
            for k, t in report["targets"].items()]
    out += [""] + [f"note: {n}" for n in report["notes"]]
    out += ["", f"syncs per minibatch: {report['syncs_per_minibatch']}; "
                f"losses match: {report['losses_match']}; elapsed {report['elapsed_s']:.0f}s"]
    return "\n".join(out)


def _f(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
