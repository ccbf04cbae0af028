"""Compare ``odcfn bench --json`` runs side by side: the headline ratios and targets of each.

    python bench/compare_runs.py results/a.json results/b.json

Keys follow docs/benchmarks.md (schema ``odcfn.bench/1``); a key a run lacks prints as ``-``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(path: Path) -> dict:
    run = json.loads(path.read_text())
    if not str(run.get("schema", "")).startswith("odcfn.bench/"):
        raise ValueError(f"{path} is not an odcfn bench JSON (schema={run.get('schema')!r})")
    return run


def rows(runs: list[dict]) -> list[tuple[str, list[str]]]:
    keys: list[str] = []
    for r in runs:
        keys += [k for k, v in r["ratios"].items() if not isinstance(v, dict) and k not in keys]
    out = []
    for k in keys:
        vals = []
        for r in runs:
            v = r["ratios"].get(k)
            met = r.get("targets", {}).get(k, {}).get("met")
            mark = "" if met is None else (" ok" if met else " MISS")
            vals.append("-" if not isinstance(v, (int, float)) else f"{v:.3f}{mark}")
        out.append((k, vals))
    for k in ("losses_match",):
        out.append((k, [str(r.get(k)) for r in runs]))
    out.append(("syncs_per_minibatch.odc", [str(r["syncs_per_minibatch"].get("odc")) for r in runs]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+")
    args = p.parse_args(argv)
    runs = [load(path) for path in args.runs]
    table = rows(runs)
    width = max(len(k) for k, _ in table)
    cols = [max(len(p.name), *(len(v[i]) for _, v in table)) for i, p in enumerate(args.runs)]
    print(" " * width + "  " + "  ".join(p.name.rjust(c) for p, c in zip(args.runs, cols)))
    for k, vals in table:
        print(k.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(vals, cols)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
