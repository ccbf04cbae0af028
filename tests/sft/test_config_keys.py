"""Every ``odcfn train`` config key is checked when the file is read: a bad value ends in one line
naming the file, the key and what it allows, with exit status 2 (issue 32, issue 29)."""

from __future__ import annotations

import json
import typing
from dataclasses import fields

import pytest

from odcfn import cli
from odcfn.sft import config as C
from odcfn.sft.keys import KEYS

SECTIONS = {"model": C.ModelSection, "data": C.DataSection, "train": C.TrainSection,
            "checkpoint": C.CheckpointSection, "log": C.LogSection, "eval": C.EvalSection,
            "lora": C.LoraSection, "dpo": C.DpoSection, "rollout": C.RolloutSection, "rl": C.RLSection,
            "offload": C.OffloadSection}

BASE = {"out_dir": "out", "data": {"path": "train.jsonl"}, "train": {"steps": 2, "world_size": 1}}


def _all_keys() -> list[tuple[str, str, str]]:
    out = [("", "out_dir", "str")]
    for name, cls in SECTIONS.items():
        out += [(name, f.name, f.type) for f in fields(cls)]
    return out


def test_the_table_names_every_config_field_and_no_other():
    assert {(s, k) for s, k, _ in _all_keys()} == set(KEYS)


def _toml_value(v) -> str:
    return json.dumps(v)  # TOML's strings, numbers, booleans and lists of strings read the same


def _write(tmp_path, doc) -> typing.Any:
    (tmp_path / "train.jsonl").write_text('{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}\n')
    lines = [f"out_dir = {_toml_value(doc['out_dir'])}"] if "out_dir" in doc else []
    for name, section in doc.items():
        if name == "out_dir":
            continue
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in section.items()]
    path = tmp_path / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _bad_values(section: str, key: str, annotation: str) -> list:
    """A wrong type and, where the rule has one, a value outside its range or choices."""
    rule, kinds = KEYS[(section, key)], str(annotation)
    out: list = ["q_proj"] if "list" in kinds else ([3] if "str" in kinds else ["three"])
    if "bool" in kinds:
        out.append(1)
    if "int" in kinds:
        out.append(1.5)
    if rule.lo is not None:
        out.append(rule.lo if rule.strict else rule.lo - 1)
    if rule.hi is not None:
        out.append(rule.hi if rule.hi_strict else rule.hi + 1)
    if rule.allowed() is not None:
        out.append(["no_such_proj"] if "list" in kinds else "no-such-value")
    return out


CASES = [(s, k, v) for s, k, a in _all_keys() for v in _bad_values(s, k, a)]


@pytest.mark.parametrize(("section", "key", "value"), CASES, ids=[f"{s}.{k}={v!r}" for s, k, v in CASES])
def test_every_bad_value_names_the_file_and_the_key(tmp_path, section, key, value):
    doc = json.loads(json.dumps(BASE))
    if section == "lora":
        doc["lora"] = {"rank": 2}
    if section:
        doc.setdefault(section, {})[key] = value
    else:
        doc[key] = value
    path = _write(tmp_path, doc)
    dotted = f"{section}.{key}" if section else key
    with pytest.raises(ValueError) as e:
        C.load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: config: ") and dotted in msg and "must be" in msg, msg


@pytest.mark.parametrize(
    ("edit", "expect"),
    [
        ({"train": {"balance": "lb-mini"}}, "train.balance must be one of ['lb_micro', 'lb_mini',"),
        ({"train": {"max_grad_norm": 0}}, "train.max_grad_norm must be a number > 0 (or unset), got 0"),
        ({"train": {"lr": -1e-3}}, "train.lr must be a number > 0, got -0.001"),
        ({"train": {"warmup_steps": 5}}, "train.warmup_steps must be <= train.steps (2), got 5"),
        ({"model": {"hf_path": "base", "d_model": 64}},
         "model.hf_path is given, so model.d_model must be left out"),
        ({"lora": {"alpha": 8.0}}, "lora.rank is required in a [lora] section"),
        ({"train": {"max_restarts": 2}}, 'train.max_restarts = 2 needs train.backend = "processes"'),
        ({"data": {"path": "missing.jsonl"}}, "data.path {tmp}/missing.jsonl does not exist"),
        ({"model": {"n_heads": 3}},
         "[model] does not describe a model odcfn builds: d_model=64 is not divisible"),
        ({"lora": {"rank": 2, "targets": ["qkv"]}}, "lora.targets must be a list of ['q_proj',"),
        ({"checkpoint": {"keep": 0}}, "checkpoint.keep must be an integer >= 1 (or unset), got 0"),
    ],
)
def test_the_issues_cases_end_in_one_line_and_exit_2(tmp_path, capsys, edit, expect):
    doc = json.loads(json.dumps(BASE))
    for name, values in edit.items():
        doc.setdefault(name, {}).update(values)
    path = _write(tmp_path, doc)
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"odcfn train: error: {path}: config: "), err
    assert expect.format(tmp=tmp_path) in err[0]


def test_a_missing_required_key_is_named(tmp_path):
    path = _write(tmp_path, {"data": {"path": "train.jsonl"}, "train": {"lr": 1e-3}})
    with pytest.raises(ValueError, match=r"config: train\.steps is required"):
        C.load_config(path)


def test_a_stored_config_with_an_hf_base_reads_back(tmp_path):
    """A checkpoint stores every key (the shape keys beside hf_path): export must read it."""
    from dataclasses import asdict

    doc = {"model": {"hf_path": "/base"}, "data": {"path": "/d.jsonl"}, "train": {"steps": 1}}
    cfg = C.config_from_dict(doc)
    assert C.config_from_stored(json.loads(json.dumps(asdict(cfg)))).model.hf_path == "/base"


def test_checkpoint_every_0_still_writes_the_final_checkpoint(tmp_path):
    doc = json.loads(json.dumps(BASE))
    doc["model"] = {"vocab_size": 16, "d_model": 8, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 8}
    doc["checkpoint"] = {"every": 0}
    doc["data"]["batch_size"] = 1
    path = _write(tmp_path, doc)
    assert cli.main(["train", "--config", str(path), "--quiet"]) == 0
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == ["step-00000002"]
