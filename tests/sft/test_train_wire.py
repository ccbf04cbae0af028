"""``odcfn train`` with the low-precision communication keys: they reach the step (the run's
logged gather bytes shrink to the format's), and a bad combination is refused when the config
is read, naming the key (the type and value checks of every key: test_config_keys.py)."""

from __future__ import annotations

import pytest

from odcfn import cli
from odcfn.sft import config as C
from tests.sft.test_sft import _metrics, _setup


def test_train_with_fp8_gathers_and_int8_pushes_runs_and_moves_fewer_bytes(tmp_path):
    runs = {}
    for name, extra in (
        ("plain", ""),
        ("quant", 'gather_format = "fp8_e4m3"\npush_format = "int8"\npush_error_feedback = true\n'),
    ):
        d = tmp_path / name
        d.mkdir()
        cfg = _setup(d, steps=3, every=0)
        cfg.write_text(cfg.read_text().replace("[checkpoint]", extra + "[checkpoint]"))
        assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
        runs[name] = _metrics(d)
    assert [r["step"] for r in runs["quant"]] == [1, 2, 3]
    # fp32 gathers against fp8 ones: 4 bytes a value against 1 plus a scale per 128
    ratio = runs["quant"][0]["gather_bytes"] / runs["plain"][0]["gather_bytes"]
    assert 0.25 < ratio < 0.3
    assert abs(runs["quant"][0]["loss"] - runs["plain"][0]["loss"]) < 0.05 * runs["plain"][0]["loss"]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ('push_format = "int8"\ncomm = "collective"\n', "config: train.push_format='int8' needs comm='odc'"),
        ("push_error_feedback = true\n", "config: train.push_error_feedback=True needs a push_format"),
        ('gather_format = "fp4"\n', "train.gather_format must be one of"),
    ],
)
def test_bad_combinations_are_refused_when_read(tmp_path, extra, match):
    cfg = _setup(tmp_path)
    text = cfg.read_text().replace('comm = "odc"\n', "")
    cfg.write_text(text.replace("[checkpoint]", extra + "[checkpoint]"))
    with pytest.raises(ValueError, match=match):
        C.load_config(cfg)
