"""``odcfn`` command line: each subcommand lives in its own module and is imported lazily
(``import torch`` alone takes seconds; ``odcfn --help`` should not).

A mistake of the user's (a bad config value, a missing file, an output directory in use) ends
in one line naming the file, the field and the fix, and exit status 2; ``--debug`` shows the
traceback instead."""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = """\
odcfn: fully sharded data-parallel LLM training with On-Demand Communication (ODC).
Ranks pull parameter shards from their owners and push gradient slices to them, so each
rank runs its own microbatches at its own pace and all ranks meet once per minibatch.

start here:
  odcfn demo                                 collective FSDP vs ODC on 2 local ranks
  odcfn train --init DIR                     write an example run config and dataset
  odcfn train --config DIR/run.toml          supervised fine-tuning (checkpoints, resume)
  odcfn export DIR/out DIR/hf                a run's checkpoint as a Hugging Face model
"""

EPILOG = "Run `odcfn COMMAND --help` for a command's options. Exit status 2 means a usage or config error."

# subcommand -> (module with `add_arguments(parser)` and `main(args) -> int`, help)
COMMANDS = {
    "demo": ("odcfn.bench.demo",
             "train a small model on 2 local ranks: collective FSDP vs ODC, side by side"),
    "train": ("odcfn.sft.loop", "supervised fine-tuning from a config file (odcfn train --init DIR for one)"),
    "export": ("odcfn.sft.export", "write an odcfn train checkpoint as a Hugging Face model directory"),
    "bench": ("odcfn.bench", "benchmarks: ODC vs collective vs torch FSDP2, primitives, stragglers"),
    "simulate": ("odcfn.schedule.sweep", "simulate balancers x devices x datasets, print bubble rates"),
    "plan": ("odcfn.schedule.show", "print the per-rank plans for a minibatch"),
}


def user_errors() -> tuple[type[BaseException], ...]:
    """What a user's input causes (wrong values and types, missing or unreadable files, an
    output directory in use): one line, not a traceback. Imported lazily, like the commands."""
    from odcfn.sft.lock import RunDirLocked

    return (ValueError, TypeError, OSError, ImportError, RunDirLocked)


def _one_line(e: BaseException) -> str:
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in msg:
        msg = f"{e.filename}: {msg}"
    return " ".join(msg.split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="odcfn", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).main(args) or 0)
    except KeyboardInterrupt:
        print(f"odcfn {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug or not isinstance(e, user_errors()):
            raise
        print(f"odcfn {args.command}: error: {_one_line(e)}  (--debug for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
