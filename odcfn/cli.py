"""``odcfn`` command line: each subcommand lives in its own module and is imported lazily
(``import torch`` alone takes seconds; ``odcfn --help`` should not)."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with `add_arguments(parser)` and `main(args) -> int`, help)
COMMANDS = {
    "demo": ("odcfn.demo", "train a small model on 2 local ranks: collective FSDP vs ODC, side by side"),
    "bench": ("odcfn.bench", "benchmarks: ODC vs collective vs torch FSDP2, primitives, stragglers"),
    "simulate": ("odcfn.schedule.sweep", "simulate balancers x devices x datasets, print bubble rates"),
    "plan": ("odcfn.schedule.show", "print the per-rank plans for a minibatch"),
    "train": ("odcfn.sft.loop", "run an SFT loop from a config file"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="odcfn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    return int(importlib.import_module(COMMANDS[args.command][0]).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
