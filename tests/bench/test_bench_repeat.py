"""``bench/run_all.py --repeat N``: the spread of each headline ratio over runs (median, min,
max, runs without it), and the loop that runs ``odcfn bench`` N times and writes the summary.
No timing here: the runs are stand-ins that write known ratios."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from odcfn.bench import repeat

ROOT = Path(__file__).resolve().parents[2]


def _report(**ratios):
    return {"ratios": ratios, "machine": {"load_average_at_start": [1.0, 1.0, 1.0]}, "elapsed_s": 1.0}


def test_spread_is_median_min_max_of_the_numbers():
    assert repeat.spread([1.2, 0.9, 1.0]) == {"median": 1.0, "min": 0.9, "max": 1.2, "n": 3}
    assert repeat.spread([1.0, 2.0]) == {"median": 1.5, "min": 1.0, "max": 2.0, "n": 2}
    # a run whose section crashed (None) or gave no number is left out, and n says so
    got = repeat.spread([None, 1.1, float("nan"), 0.95])
    assert got == {"median": 1.025, "min": 0.95, "max": 1.1, "n": 2}
    assert repeat.spread([None, None])["n"] == 0


def test_aggregate_takes_each_headline_ratio_over_the_runs():
    runs = [_report(odc_lb_mini_over_collective_lb_micro=v,
                    straggler_odc_lb_mini_over_collective_shm_lb_micro=s)
            for v, s in ((1.20, 0.99), (1.05, 1.01), (1.10, None))]
    agg = repeat.aggregate(runs)
    assert list(agg) == [k for k, _ in repeat.HEADLINE]
    head = agg["odc_lb_mini_over_collective_lb_micro"]
    assert (head["median"], head["min"], head["max"], head["n"]) == (1.10, 1.05, 1.20, 3)
    assert head["runs"] == [1.20, 1.05, 1.10]
    assert agg["straggler_odc_lb_mini_over_collective_shm_lb_micro"]["n"] == 2
    assert agg["odc_work_stealing_over_odc_lb_mini"]["n"] == 0
    text = repeat.render(agg, 3)
    assert "1.100x [1.050-1.200]" in text and "over 3 runs" in text
    assert "(1 runs without it)" in text and "(3 runs without it)" in text


def test_bench_args_default_to_the_headline_sections_on_the_larger_model():
    assert repeat.bench_args([]) == [*repeat.DEFAULT_ARGS, *repeat.DEFAULT_MODEL]
    assert repeat.bench_args(["--only", "rl"]) == ["--only", "rl", *repeat.DEFAULT_MODEL]
    assert repeat.bench_args(["--d-model", "64"]) == ["--d-model", "64"]


@pytest.fixture
def run_all(monkeypatch):
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "bench" / "run_all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls = []

    def fake_bench(argv):  # writes a report with a different ratio per run, as a run would
        calls.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        ratio = [1.3, 0.9, 1.1][len(calls) - 1]
        out.write_text(json.dumps(_report(odc_lb_mini_over_collective_lb_micro=ratio)))
        return 0

    monkeypatch.setattr(mod, "odcfn_main", fake_bench)
    return mod, calls


def test_repeat_runs_the_bench_n_times_and_writes_the_spread(run_all, tmp_path, capsys):
    mod, calls = run_all
    assert mod.main(["--repeat", "3", "--results", str(tmp_path)]) == 0
    assert len(calls) == 3 and all(c[0] == "bench" and c[3:] == repeat.bench_args([]) for c in calls)
    summary = json.loads(next(tmp_path.glob("*-repeat3.json")).read_text())
    assert summary["schema"] == repeat.SCHEMA and len(summary["runs"]) == 3
    assert all((tmp_path / name).exists() for name in summary["runs"])
    s = summary["ratios"]["odc_lb_mini_over_collective_lb_micro"]
    assert (s["median"], s["min"], s["max"]) == (1.1, 0.9, 1.3)
    assert "1.100x [0.900-1.300]" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mod.main(["--repeat", "0", "--results", str(tmp_path)])
