"""Smoke tests of ``odcfn demo`` with a toy model (structure and outputs, never timings)."""

from __future__ import annotations

import argparse
import builtins
import json

import pytest

from odcfn.bench import demo
from odcfn.schedule.policy import HEADLINE

TINY = ["--d-model", "16", "--n-layers", "1", "--length-scale", "1024", "--samples-per-rank", "2",
        "--steps", "1", "--warmup", "0", "--no-progress"]


def _run(argv):
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return demo.main(p.parse_args(argv))


def test_demo_prints_the_table_and_writes_trace_and_png(tmp_path, capsys):
    assert _run([*TINY, "--backend", "thread", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for policy in HEADLINE:
        assert policy in out
    assert "losses match across the three runs: yes" in out
    trace = json.loads((tmp_path / "demo_trace.json").read_text())
    procs = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert procs == {f"{p} / rank {r}" for p in HEADLINE for r in (0, 1)}
    kinds = {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"forward", "backward", "sync"} <= kinds
    assert str(tmp_path / "demo_trace.json") in out
    png = tmp_path / "demo_timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_survives_without_matplotlib(tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib here")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    assert _run([*TINY, "--backend", "thread", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "timeline PNG skipped" in out
    assert (tmp_path / "demo_trace.json").exists() and not (tmp_path / "demo_timeline.png").exists()


def test_demo_on_real_processes(tmp_path, capsys):
    assert _run([*TINY, "--backend", "process", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "process backend" in out and "losses match across the three runs: yes" in out


def test_cli_dispatches_to_demo_and_bench(capsys):
    from odcfn.cli import main

    for cmd in ("demo", "bench"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert "--samples-per-rank" in capsys.readouterr().out


def test_demo_survives_a_failing_calibration(tmp_path, capsys, monkeypatch):
    import odcfn.bench.sim

    def broken(*a, **k):
        raise RuntimeError("no timer today")

    monkeypatch.setattr(odcfn.bench.sim, "calibrate_cost", broken)
    assert _run([*TINY, "--backend", "thread", "--out-dir", str(tmp_path)]) == 0
    assert "calibration failed (RuntimeError: no timer today)" in capsys.readouterr().out
