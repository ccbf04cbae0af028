"""Where data lives and how it is mixed: a ``datasets`` directory (``save_to_disk``), a folder of
parquet shards and the same rows as JSONL give identical minibatches; ``[[data.sources]]`` mix
by weight, deterministically per step; ``data.eval_path`` is read and checked; and each kind of
bad input is an error naming the file, the row and the column (or the config key)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from odcfn import cli
from odcfn.sft.config import config_from_dict, load_config
from odcfn.sft.prepare import prepare_data
from tests.data.test_chat_data import _tokenizer

VOCAB = 300
U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
WORDS = ["hello there", "the cat sat", "two plus two", "on the mat", "fine, thanks!", "how are you?"]
ROWS = [{"messages": [U(WORDS[i % 6]), A(WORDS[(i + 1) % 6] + " " + WORDS[(i + 3) % 6])]} for i in range(12)]
PC_ROWS = [{"prompt": WORDS[i % 6], "completion": " " + WORDS[(i + 2) % 6]} for i in range(7)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(tmp_path, tok_dir, data: dict, steps: int = 6, **train):
    data = {"batch_size": 4, "tokenizer": str(tok_dir), "cache_dir": str(tmp_path / "cache"), **data}
    return config_from_dict({"data": data, "train": {"steps": steps, **train}}, base_dir=tmp_path)


def _batches(cfg, steps: int) -> list[list[tuple[list[int], list[bool]]]]:
    p = prepare_data(cfg, VOCAB)
    return [[(s.tokens.tolist(), s.loss_mask.tolist()) for s in p.batch(k, cfg.data).samples]
            for k in range(steps)]


def test_a_saved_dataset_parquet_shards_and_jsonl_give_identical_minibatches(tmp_path, tok_dir):
    jsonl = _jsonl(tmp_path / "chats.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    shards = tmp_path / "shards" / "data"
    shards.mkdir(parents=True)
    for k in range(3):  # 5 + 5 + 2 rows, read in name order
        part = pa.Table.from_pylist(ROWS[5 * k: 5 * k + 5])
        pq.write_table(part, shards / f"train-{k:05d}-of-00003.parquet")
    want = _batches(_cfg(tmp_path, tok_dir, {"path": jsonl}), 6)  # 2 epochs, reshuffled
    assert want == _batches(_cfg(tmp_path, tok_dir, {"path": "saved"}), 6)
    assert want == _batches(_cfg(tmp_path, tok_dir, {"path": "shards"}), 6)
    # the same with TRL's prompt-completion rows, which need no chat template's offsets
    datasets.Dataset.from_list(PC_ROWS).save_to_disk(str(tmp_path / "pc"))
    pc = _jsonl(tmp_path / "pc.jsonl", PC_ROWS)
    want = _batches(_cfg(tmp_path, tok_dir, {"path": pc}), 3)
    assert want == _batches(_cfg(tmp_path, tok_dir, {"path": "pc"}), 3)


def test_rows_are_named_by_their_shard_and_row(tmp_path, tok_dir):
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(PC_ROWS[:3]), shards / "a.parquet")
    rows = PC_ROWS[3:5] + [{"prompt": "the cat"}]  # the last row has no completion: null in parquet
    pq.write_table(pa.Table.from_pylist(rows), shards / "b.parquet")
    with pytest.raises(ValueError, match=r"shards/b.parquet: row 2: no 'completion' column; the file is in "
                                         r"the prompt-completion format"):
        prepare_data(_cfg(tmp_path, tok_dir, {"path": "shards"}), VOCAB)
    pq.write_table(pa.Table.from_pylist(PC_ROWS[3:5]), shards / "b.parquet")
    full = prepare_data(_cfg(tmp_path, tok_dir, {"path": "shards"}), VOCAB).dataset
    assert [full.where(i)[len(str(shards)) + 1:] for i in (0, 2, 3, 4)] == [
        "a.parquet: row 0", "a.parquet: row 2", "b.parquet: row 0", "b.parquet: row 1"]
    i = max(range(len(full)), key=lambda k: full.samples[k].length)
    cfg = _cfg(tmp_path, tok_dir, {"path": "shards", "max_length": full.samples[i].length - 1,
                                   "long_samples": "drop"})
    # a dropped sample is named by its shard and row, wherever it was
    assert full.where(i) in prepare_data(cfg, VOCAB).dropped


def test_sources_mix_by_weight_deterministically(tmp_path, tok_dir):
    a = _jsonl(tmp_path / "a.jsonl", ROWS)  # 12 chats
    b = _jsonl(tmp_path / "b.jsonl", PC_ROWS)  # 7 prompt-completion rows
    sources = [{"path": "a.jsonl", "weight": 3}, {"path": "b.jsonl"}]
    cfg = _cfg(tmp_path, tok_dir, {"sources": sources}, steps=10)
    assert cfg.data.sources == [{"path": a, "weight": 3.0}, {"path": b, "weight": 1.0}]
    p = prepare_data(cfg, VOCAB)
    assert len(p.dataset) == 19 and p.formats == ("messages", "prompt_completion")
    drawn = [p.indices(k, cfg.data) for k in range(10)]
    assert drawn == [prepare_data(cfg, VOCAB).indices(k, cfg.data) for k in range(10)]  # a pure function
    for ids in drawn:  # every step holds each source's share: 3 of a, 1 of b
        assert Counter(j >= 12 for j in ids) == {False: 3, True: 1}
    firsts = [j for ids in drawn[:4] for j in ids if j < 12]  # a's first 12 draws: each chat once
    assert sorted(firsts) == list(range(12))
    seen_b = [j - 12 for ids in drawn for j in ids if j >= 12]  # b's: an epoch of 7, then the next
    assert sorted(seen_b[:7]) == list(range(7))
    assert p.dataset.where(12).endswith("b.jsonl:1")


def test_odcfn_train_runs_on_a_mixture_of_a_saved_dataset_and_a_jsonl_file(tmp_path, tok_dir, capsys):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    _jsonl(tmp_path / "pc.jsonl", PC_ROWS)
    _jsonl(tmp_path / "held.jsonl", PC_ROWS[:3])
    (tmp_path / "run.toml").write_text(
        f'out_dir = "out"\n[model]\nvocab_size = {VOCAB}\nd_model = 16\nn_layers = 1\nd_ff = 32\n'
        f'[data]\nbatch_size = 4\ntokenizer = "{tok_dir}"\neval_path = "held.jsonl"\n'
        '[[data.sources]]\npath = "saved"\nweight = 1\n[[data.sources]]\npath = "pc.jsonl"\nweight = 1\n'
        "[train]\nsteps = 2\nworld_size = 1\n"
    )
    assert cli.main(["train", "--config", str(tmp_path / "run.toml")]) == 0
    out = capsys.readouterr().out
    assert "(chat, prompt-completion, tokenizer" in out and "mixed by weight" in out
    assert "eval data: " in out and "held.jsonl: 3 samples" in out
    metrics = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in metrics if '"loss"' in line]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_an_eval_set_is_read_and_must_have_loss_tokens(tmp_path, tok_dir):
    train = _jsonl(tmp_path / "t.jsonl", ROWS)
    _jsonl(tmp_path / "e.jsonl", ROWS[:3])
    p = prepare_data(_cfg(tmp_path, tok_dir, {"path": train, "eval_path": "e.jsonl"}), VOCAB)
    assert len(p.eval) == 3 and sum(s.num_loss_tokens for s in p.eval.samples) > 0
    rec = [{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}, {"input_ids": [4, 5], "loss_mask": [1, 0]}]
    tokens = _jsonl(tmp_path / "tok.jsonl", [{"input_ids": [1, 2, 3]}] * 4)
    _jsonl(tmp_path / "empty.jsonl", rec)
    cfg = config_from_dict({"data": {"path": tokens, "batch_size": 2, "eval_path": "empty.jsonl"},
                            "train": {"steps": 1}}, base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"empty.jsonl:1: data.eval_path .*empty.jsonl has no loss tokens: "
                                         r"none of its 2 rows .*'loss_mask'"):
        prepare_data(cfg, VOCAB)


def _toml(tmp_path, data: str) -> Path:
    (tmp_path / "a.jsonl").write_text('{"input_ids": [1, 2, 3]}\n' * 4)
    path = tmp_path / "run.toml"
    path.write_text(f"[data]\n{data}\n[train]\nsteps = 1\n")
    return path


@pytest.mark.parametrize("data,match", [
    ('[[data.sources]]\npath = "a.jsonl"\nweight = 2\n[[data.sources]]\npath = "a.jsonl"\nweight = 0',
     r"run.toml: config: \[\[data.sources\]\] entry 2 \(.*a.jsonl\): 'weight' must be a number > 0.*got 0"),
    ('[[data.sources]]\npath = "a.jsonl"\nweight = -1.5',
     r"entry 1 .*'weight' must be a number > 0.*got -1.5"),
    ('path = "a.jsonl"\n[[data.sources]]\npath = "a.jsonl"',
     r"give data.path or \[\[data.sources\]\], not both"),
    ('[[data.sources]]\npath = "missing"', r"\[\[data.sources\]\] entry 1 path .*missing does not exist"),
    ('[[data.sources]]\npath = "a.jsonl"\nshare = 1', r"entry 1: unknown keys \['share'\]"),
])
def test_bad_sources_are_named_in_the_config_file(tmp_path, data, match):
    with pytest.raises(ValueError, match=match):
        load_config(_toml(tmp_path, data))


@pytest.mark.parametrize("rows,match", [
    ([{"question": "a", "answer": "b"}],
     r"d.jsonl:1: the columns \['answer', 'question'\] match no dataset format; each format needs these "
     r"columns: token records \(sft\): 'input_ids'; preference \(dpo\): 'prompt' \+ 'chosen' \+ "
     r"'rejected'; .*"
     r"language modeling \(sft\): 'text'; prompt-only \(rl\): 'prompt'"),
    (PC_ROWS[:2] + [{"prompt": "the cat"}],
     r"d.jsonl:3: no 'completion' column; the file is in the prompt-completion format, which needs "
     r"'prompt' \+ 'completion'"),
    (PC_ROWS[:1] + [{"prompt": "the cat", "completion": ""}], r"d.jsonl:2: column 'completion' is empty"),
    ([{"messages": [U("hi"), A("hello there")]}, {"messages": [U("hi"), U("the cat?")]}],
     r"d.jsonl:2: column 'messages' has no 'assistant' turn"),
    ([{"prompt": [U("hi")], "completion": [U("the cat?")]}],
     r"d.jsonl:1: column 'completion' has no 'assistant'"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}],
     r"d.jsonl:1: the columns .* are the preference format, which trains with train.task = 'dpo', not 'sft'"),
    ([{"text": [U("hi")]}],
     r"d.jsonl:1: column 'text' must be text; conversations go in a 'messages' column"),
])
def test_bad_rows_are_named_by_file_row_and_column(tmp_path, tok_dir, rows, match):
    cfg = _cfg(tmp_path, tok_dir, {"path": _jsonl(tmp_path / "d.jsonl", rows), "batch_size": 2}, steps=1)
    with pytest.raises(ValueError, match=match):
        prepare_data(cfg, VOCAB)


def test_text_rows_need_a_tokenizer_and_a_dataset_dict_needs_a_split(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", PC_ROWS)
    cfg = config_from_dict({"data": {"path": path, "batch_size": 2}, "train": {"steps": 1}})
    with pytest.raises(ValueError, match=r"d.jsonl: rows in the prompt-completion format .* set "
                                         r"data.tokenizer"):
        prepare_data(cfg, VOCAB)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(PC_ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"dd is a datasets DatasetDict with splits \['train'\]: name one "
                                         r"split's directory, e.g. .*dd/train"):
        load_config(_toml(tmp_path, 'path = "dd"'))


def test_preference_rows_from_a_saved_dataset_with_an_eval_set(tmp_path, tok_dir):
    rows = [{"chosen": [U(WORDS[i]), A(WORDS[(i + 1) % 6])], "rejected": [U(WORDS[i]), A(WORDS[(i + 2) % 6])]}
            for i in range(6)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "pairs"))
    _jsonl(tmp_path / "held.jsonl", rows[:2])
    cfg = _cfg(tmp_path, tok_dir, {"path": "pairs", "eval_path": "held.jsonl", "batch_size": 2}, task="dpo")
    p = prepare_data(cfg, VOCAB)
    assert len(p.pairs) == 6 and len(p.eval) == 2
    assert [s.tokens.tolist() for s in p.eval[0]] == [s.tokens.tolist() for s in p.pairs[0]]
