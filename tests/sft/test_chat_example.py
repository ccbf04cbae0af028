"""The chat SFT example runs offline: a tiny tokenizer ships in examples/chat/tokenizer, and
data.tokenizer reads a local directory only (no download is attempted)."""

from __future__ import annotations

import shutil
from pathlib import Path

import transformers  # noqa: F401 (a hard requirement of these tests)

from odcfn import cli

EXAMPLE = Path(__file__).parents[2] / "examples" / "chat"


def test_the_chat_example_trains_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any download attempt fails
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    shutil.copytree(EXAMPLE, tmp_path / "chat", ignore=shutil.ignore_patterns("out", "*.odcfn-cache"))
    cfg = tmp_path / "chat" / "run.toml"
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert f"data: {tmp_path}/chat/chats.jsonl (chat, tokenizer {tmp_path}/chat/tokenizer): 16 samples" in out
    assert "steps 0..4 on 1 rank(s)" in out


def test_the_shipped_tokenizer_is_what_the_script_builds(tmp_path):
    """The files in the repository are the script's output, not a hand-edited copy."""
    import importlib.util

    shutil.copytree(EXAMPLE, tmp_path / "chat", ignore=shutil.ignore_patterns("out", "*.odcfn-cache"))
    shutil.rmtree(tmp_path / "chat" / "tokenizer")
    spec = importlib.util.spec_from_file_location("make_tokenizer", tmp_path / "chat" / "make_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    for f in (EXAMPLE / "tokenizer").iterdir():
        assert (tmp_path / "chat" / "tokenizer" / f.name).read_text() == f.read_text(), f.name
