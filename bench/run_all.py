"""Run ``odcfn bench`` and keep its JSON next to a note of the machine's load, for
docs/benchmarks.md:

    python bench/run_all.py                 # full: ~10 min on 2 cores
    python bench/run_all.py --quick         # < 3 min
    python bench/run_all.py -- --only primitives --sizes-mib 1 4 16 64

Writes ``bench/results/<UTC time>[-quick].json`` and prints the human report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from odcfn.cli import main as odcfn_main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("rest", nargs="*", help="more `odcfn bench` arguments (after --)")
    args = p.parse_args(argv)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = args.results / f"{stamp}{'-quick' if args.quick else ''}.json"
    code = odcfn_main(["bench", "--out", str(out), *(["--quick"] if args.quick else []), *args.rest])
    run = json.loads(out.read_text())
    print(f"\nwrote {out} (load average at start: {run['machine']['load_average_at_start']})")
    return code


if __name__ == "__main__":
    sys.exit(main())
