"""``odcfn train`` with the low-precision communication keys: they reach the step (the run's
logged gather bytes shrink to the format's), a bad combination is refused when the config is
read, naming the key (the type and value checks of every key: test_config_keys.py), and a
resume continues the error-feedback residuals."""

from __future__ import annotations

import pytest

import odcfn
from odcfn import cli
from odcfn.checkpoint.sharded import read_manifest
from odcfn.sft import config as C
from odcfn.sft.setup import setup
from tests.sft.test_sft import _final_params, _metrics, _setup


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


def test_a_lora_run_with_its_base_held_in_int8_logs_the_same_losses(tmp_path):
    """``train.quantize_frozen`` reaches the step (the run holds its base in int8) and changes
    no loss: the gathers delivered the same dequantized base either way."""
    runs = {}
    for name in ("full", "held"):
        d = tmp_path / name
        d.mkdir()
        cfg = _setup(d, steps=2, every=0, extra="[lora]\nrank = 2\n")
        keys = 'gather_format = "int8"\ndeterministic = true\n'
        keys += "quantize_frozen = true\n" if name == "held" else ""
        cfg.write_text(cfg.read_text().replace("[checkpoint]", keys + "[checkpoint]"))
        assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
        runs[name] = [r["loss"] for r in _metrics(d)]
        c = C.load_config(cfg)
        held = odcfn.run_local(lambda rank, tr, c=c: {
            str(v.dtype) for k, v in setup(c, rank, tr).state.params.items() if k in ("embed", "head")}, 2)
        assert held == [{"torch.int8"}] * 2 if name == "held" else held == [{"torch.float32"}] * 2
    assert len(runs["held"]) == 2 and runs["held"] == runs["full"]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ('push_format = "int8"\ncomm = "collective"\n', "config: train.push_format='int8' needs comm='odc'"),
        ("push_error_feedback = true\n", "config: train.push_error_feedback=True needs a push_format"),
        ('gather_format = "fp4"\n', "train.gather_format must be one of"),
        ("quantize_frozen = true\n", "config: train.quantize_frozen=True needs a gather_format"),
    ],
)
def test_bad_combinations_are_refused_when_read(tmp_path, extra, match):
    cfg = _setup(tmp_path)
    text = cfg.read_text().replace('comm = "odc"\n', "")
    cfg.write_text(text.replace("[checkpoint]", extra + "[checkpoint]"))
    with pytest.raises(ValueError, match=match):
        C.load_config(cfg)


QUANT = 'push_format = "int8"\npush_error_feedback = true\n'


def _quant_setup(d, extra=QUANT):
    cfg = _setup(d)  # 6 steps, a checkpoint every 3
    cfg.write_text(cfg.read_text().replace("[checkpoint]", extra + "[checkpoint]"))
    return cfg


def test_resume_with_error_feedback_continues_bit_identically(tmp_path):
    """The residuals are in the checkpoints ``odcfn train`` resumes from: stopped at step 3 and
    resumed equals the uninterrupted run (one microbatch per rank: two pushes into each owner, a
    sum in any order). Without them the resumed pushes would start from a zero residual."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert cli.main(["train", "--config", str(_quant_setup(a)), "--quiet"]) == 0
    cfg_b = _quant_setup(b)
    assert cli.main(["train", "--config", str(cfg_b), "--steps", "3", "--quiet"]) == 0
    assert cli.main(["train", "--config", str(cfg_b), "--quiet"]) == 0  # resumes from step 3
    ra, rb = _metrics(a), _metrics(b)
    assert [r["step"] for r in rb] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    odcfn.tree_assert_allclose(_final_params(a), _final_params(b), rtol=0, atol=0)
    saved = read_manifest(b / "out" / "checkpoints" / "step-00000006")["extra"]["push_feedback"]
    assert saved["push_format"] == "int8"


def test_switching_error_feedback_on_at_a_resume_needs_resume_anyway(tmp_path, capsys):
    cfg = _quant_setup(tmp_path, 'push_format = "int8"\n')
    assert cli.main(["train", "--config", str(cfg), "--steps", "3", "--quiet"]) == 0
    cfg.write_text(cfg.read_text().replace('push_format = "int8"\n', QUANT))
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) != 0  # a config change: refused
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--resume-anyway"]) == 0
    err = capsys.readouterr().err
    assert "holds no error-feedback residuals" in err and "residuals start at zero" in err
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_error_feedback_across_nodes_is_refused_before_the_first_step(tmp_path):
    """Several nodes run hybrid sharding, where only node 0's ranks write checkpoint files: the
    other ranks' residuals could not be saved, so the run is refused at setup (not at its first
    checkpoint), on every rank alike."""
    from odcfn.sft.setup import setup

    cfg = C.load_config(_quant_setup(tmp_path))

    def fn(rank, tr):
        with pytest.raises(ValueError, match="odcfn train: StepConfig.push_error_feedback=True under hybrid"):
            setup(cfg, rank, tr)
        return tr.counters.gathers + tr.counters.scatters

    assert odcfn.run_local(fn, 2, ranks_per_node=1, sharding="hybrid", timeout=60) == [0, 0]
