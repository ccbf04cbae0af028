"""Run ``odcfn bench`` and keep its JSON next to a note of the machine's load, for
docs/benchmarks.md:

    python bench/run_all.py                 # full: ~10 min on 2 cores
    python bench/run_all.py --quick         # < 3 min
    python bench/run_all.py -- --only primitives --sizes-mib 1 4 16 64
    python bench/run_all.py --repeat 3      # the headline sections 3 times: median [min-max]

Writes ``bench/results/<UTC time>[-quick].json`` and prints the human report. With
``--repeat N`` it runs ``odcfn bench`` N times (by default the headline sections, end_to_end,
balanced and straggler, on a 3.4M-parameter model: ``odcfn.bench.repeat``), writes each run's
JSON as ``<time>-rI-of-N.json`` and a summary ``<time>-repeatN.json`` with every headline ratio
as a median with its range over the runs, and prints that table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from odcfn.bench import repeat
from odcfn.cli import main as odcfn_main


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def run_repeated(n: int, rest: list[str], results: Path, quick: bool = False) -> int:
    stamp = _stamp()
    args = repeat.bench_args(rest) + (["--quick"] if quick else [])
    paths, reports, codes = [], [], []
    for i in range(1, n + 1):
        out = results / f"{stamp}-r{i}-of-{n}.json"
        print(f"== repeat {i}/{n}: odcfn bench {' '.join(args)}", file=sys.stderr, flush=True)
        codes.append(odcfn_main(["bench", "--out", str(out), *args]))
        paths.append(out.name)
        reports.append(json.loads(out.read_text()))
    agg = repeat.aggregate(reports)
    summary = {
        "schema": repeat.SCHEMA,
        "command": f"python bench/run_all.py --repeat {n}" + (" --quick" if quick else "")
                   + (" -- " + " ".join(rest) if rest else ""),
        "bench_args": args,
        "runs": paths,
        "load_average_at_start": [r["machine"]["load_average_at_start"] for r in reports],
        "elapsed_s": [r.get("elapsed_s") for r in reports],
        "ratios": agg,
    }
    out = results / f"{stamp}-repeat{n}.json"
    out.write_text(json.dumps(summary, indent=1))
    print("\n" + repeat.render(agg, n))
    print(f"\nwrote {out} (runs: {', '.join(paths)}; load average at each start: "
          f"{summary['load_average_at_start']})")
    return max(codes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=None, metavar="N",
                   help="run N times and report each headline ratio as median [min-max]")
    p.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("rest", nargs="*", help="more `odcfn bench` arguments (after --)")
    args = p.parse_args(argv)
    if args.repeat is not None:
        if args.repeat < 1:
            p.error(f"--repeat must be >= 1, got {args.repeat}")
        return run_repeated(args.repeat, args.rest, args.results, args.quick)
    out = args.results / f"{_stamp()}{'-quick' if args.quick else ''}.json"
    code = odcfn_main(["bench", "--out", str(out), *(["--quick"] if args.quick else []), *args.rest])
    run = json.loads(out.read_text())
    print(f"\nwrote {out} (load average at start: {run['machine']['load_average_at_start']})")
    return code


if __name__ == "__main__":
    sys.exit(main())
