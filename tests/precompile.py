"""Bytecode for the whole suite, written once by the controlling pytest process before any
worker starts.

Without it, every interpreter the suite starts (four xdist workers, the warm pool, every spawned
rank, torchrun agent, ``odcfn`` subprocess and notebook kernel: a few hundred) compiles the
modules of ``odcfn`` and ``tests`` it imports from source (about 0.35 s of CPU each), and every
xdist worker rewrites the asserts of all ~160 test modules again (about 10 s of CPU each). That
is what happens where ``PYTHONDONTWRITEBYTECODE`` is set, as on this project's machines:
Python then never writes a ``.pyc`` on import, but it still reads one. So the controller writes
them explicitly (``compileall``; for the test modules, pytest's own rewritten ``.pyc`` format),
and every later process only reads. The files go to ``__pycache__``, which git ignores; a
directory that cannot be written is left as it is (this is a speed-up, never a requirement)."""

from __future__ import annotations

import compileall
from pathlib import Path

import pytest
from _pytest.assertion import rewrite as rw  # pytest's own rewrite and cache format

ROOT = Path(__file__).resolve().parents[1]


def precompile(config: pytest.Config) -> None:
    """Plain bytecode for ``odcfn/`` and ``tests/``, and pytest's assert-rewritten bytecode for
    the test modules and conftest files. Call from the controller's ``pytest_configure``."""
    for d in ("odcfn", "tests"):
        compileall.compile_dir(ROOT / d, quiet=2)  # errors too: a syntax error fails at import
    try:  # the format pytest's import hook reads back (private names: a later pytest may differ)
        state = config.stash[rw.assertstate_key]
        for fn in sorted((ROOT / "tests").rglob("*.py")):
            if not (fn.name.startswith("test_") or fn.name == "conftest.py"):
                continue
            cache = rw.get_cache_dir(fn)
            pyc = cache / (fn.name[:-3] + rw.PYC_TAIL)
            if rw.try_makedirs(cache) and rw._read_pyc(fn, pyc, state.trace) is None:
                source_hash, co = rw._rewrite_test(fn, config)
                rw._write_pyc(state, co, source_hash, pyc)
    except (AttributeError, KeyError, TypeError, OSError, SyntaxError):
        pass  # another pytest's internals, or a read-only tree: the workers rewrite as usual
