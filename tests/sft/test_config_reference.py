"""One source of truth for the config: docs/config.md and ``odcfn train --init`` are written from
the config's definition, and name every section and key."""

from __future__ import annotations

import re
from pathlib import Path

from odcfn import cli
from odcfn.sft.config import load_config
from odcfn.sft.keys import KEYS
from odcfn.sft.reference import config_markdown

ROOT = Path(__file__).parents[2]


def test_docs_config_md_is_the_generated_reference():
    assert (ROOT / "docs" / "config.md").read_text() == config_markdown(), (
        "docs/config.md is stale: python -m odcfn.sft.reference > docs/config.md"
    )


def test_the_reference_names_every_key():
    text = config_markdown()
    for section, key in KEYS:
        head = f"## [{section}]" if section else "## top level"
        part = text[text.index(head):]
        part = part[: part.find("\n## ", 1) if "\n## " in part[1:] else len(part)]
        assert f"| `{key}` |" in part, (section, key)


def test_init_writes_every_section_and_key_with_a_comment_and_runs(tmp_path, capsys):
    assert cli.main(["train", "--init", str(tmp_path / "ex")]) == 0
    text = (tmp_path / "ex" / "run.toml").read_text()
    section, seen = "", set()
    for line in text.splitlines():
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section = m.group(1)
        elif m := re.match(r"(?:# )?(\w+) = .*  # .+ \(default: .+\)$", line):
            seen.add((section, m.group(1)))
    assert seen == set(KEYS)
    assert "[lora]" in text and "timeout = " in text and "remat = " in text and "# export_hf = " in text
    cfg = load_config(tmp_path / "ex" / "run.toml")  # the written file is a valid config as it stands
    assert cfg.train.steps == 12 and cfg.lora.rank == 0 and cfg.train.world_size == 2
