"""Preference records (TRL's plain-text and conversational formats) + a local tokenizer ->
(chosen, rejected) pairs whose only targets are the answers; bad records are named."""

from __future__ import annotations

import json

import pytest
import tokenizers  # noqa: F401 (a hard requirement of these tests)
import transformers  # noqa: F401

import odcfn
from odcfn.data.preference import read_preference_jsonl
from tests.data.test_chat_data import _tokenizer  # noqa: E402  (after the skips: it needs both)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _targets(tok, s):
    return tok.decode([int(t) for t, m in zip(s.tokens, s.loss_mask) if m])


def test_plain_and_conversational_pairs_train_on_the_answers_only(tok_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "fine, thanks!"},
               {"role": "user", "content": "two plus two"}]
    path = _write(tmp_path / "p.jsonl", [
        {"prompt": "two plus two is", "chosen": " four", "rejected": " the cat"},
        {"prompt": history, "chosen": [{"role": "assistant", "content": "four"}],
         "rejected": [{"role": "assistant", "content": "the mat"}]},
    ])
    (c0, r0), (c1, r1) = read_preference_jsonl(path, tok_dir)
    assert _targets(tok, c0) == " four<|im_end|>" and _targets(tok, r0) == " the cat<|im_end|>"
    assert tok.decode([int(t) for t in c0.tokens]).startswith("two plus two is")
    # the history's assistant turn is context: only the answer's turn (and what closes it) is trained
    assert _targets(tok, c1).strip() == "four<|im_end|>" and _targets(tok, r1).strip() == "the mat<|im_end|>"
    assert "fine" in tok.decode([int(t) for t in c1.tokens])
    batch = odcfn.preference_batch([(c0, r0), (c1, r1)])
    assert batch.pairs and len(batch) == 4


@pytest.mark.parametrize("rec,msg", [
    ({"prompt": "a", "chosen": "b"}, "p.jsonl:2: no 'rejected' column; the file is in the preference format"),
    ({"prompt": "a", "chosen": "b", "rejected": ["x"]},
     "p.jsonl:2: columns mix the standard and the conversational form.*'rejected': conversational"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"},
     "p.jsonl:2: columns mix the standard and the conversational form.*'chosen': standard"),
])
def test_bad_records_are_named_by_line_and_field(tok_dir, tmp_path, rec, msg):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, rec])
    with pytest.raises(ValueError, match=msg):
        read_preference_jsonl(path, tok_dir)


def test_an_empty_answer_with_an_explicit_prompt_is_named_not_refused(tok_dir, tmp_path):
    """It still prefers or rejects the end of the answer (EOS): named as odd (issue 40, item 21)."""
    path = _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                         {"prompt": "a", "chosen": "", "rejected": "c"}])
    with pytest.warns(UserWarning, match=r"p.jsonl:2 chosen is empty"):
        assert len(read_preference_jsonl(path, tok_dir)) == 2


def test_a_member_over_max_length_is_an_error(tok_dir, tmp_path):
    rec = {"prompt": "hello there", "chosen": " fine", "rejected": " the cat sat"}
    path = _write(tmp_path / "p.jsonl", [rec])
    with pytest.raises(ValueError, match=r"p.jsonl:1 (chosen|rejected): \d+ tokens, more than max_length=3"):
        read_preference_jsonl(path, tok_dir, max_length=3)
