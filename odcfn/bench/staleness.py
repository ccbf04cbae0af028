"""``python -m odcfn.bench.staleness [options]``: ``odcfn bench --only staleness [options]``, the
bounded-staleness section (``odcfn.bench.staleness_section``; its runs:
``odcfn.bench.staleness_runs``). It was an in-process bench before; the section runs processes.

Nothing in ``odcfn`` imports this module: it imports ``odcfn.bench``, whose sections must not
import it back.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] = ()) -> int:
    """``odcfn bench --only staleness`` with ``argv``'s further options."""
    from odcfn import bench

    p = argparse.ArgumentParser(prog="python -m odcfn.bench.staleness")
    bench.add_arguments(p)
    return bench.main(p.parse_args(["--only", "staleness", *argv]))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
