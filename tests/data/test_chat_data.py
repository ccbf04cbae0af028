"""Chat transcripts + a local tokenizer -> samples that train on assistant tokens only, cached
as token-id shards; ``odcfn train`` on chat data."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # noqa: F401  (the chat template is rendered by transformers)

from odcfn.data import chat as chat_data
from odcfn.data.chat import read_chat_jsonl

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["hello there, how are you?", "the cat sat on the mat", "two plus two is four", "fine, thanks!"]


def _tokenizer(path, template=TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    kw = {"chat_template": template} if template else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", **kw)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("tok") / "tok")


CHATS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "fine, thanks!"}],
    [
        {"role": "system", "content": "be short"},
        {"role": "user", "content": "two plus two?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "and the cat?"},
        {"role": "assistant", "content": "the cat sat on the mat"},
    ],
]


def _write(path, chats, extra=()):
    path.write_text("\n".join([json.dumps({"messages": c}) for c in chats] + list(extra)) + "\n")
    return path


def _runs(sample):
    """Contiguous runs of target tokens."""
    runs, cur = [], []
    for t, m in zip(sample.tokens.tolist(), sample.loss_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def test_targets_are_exactly_the_assistant_turns(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    ds = read_chat_jsonl(_write(tmp_path / "c.jsonl", CHATS), tok_dir, vocab_size=len(tok))
    assert len(ds) == 2
    for sample, chat in zip(ds.samples, CHATS):
        # the whole conversation is the template's text, and the targets decode to each
        # assistant reply plus the end of its turn, nothing else
        assert tok.decode(sample.tokens.tolist()) == tok.apply_chat_template(chat, tokenize=False)
        want = [f"{m['content']}<|im_end|>\n" for m in chat if m["role"] == "assistant"]
        assert [tok.decode(r) for r in _runs(sample)] == want
    assert ds.samples[1].num_loss_tokens < ds.samples[1].length // 2


def test_cache_means_no_retokenizing(tmp_path, tok_dir, monkeypatch):
    data = _write(tmp_path / "c.jsonl", CHATS)
    first = read_chat_jsonl(data, tok_dir, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 1

    def boom(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(chat_data, "tokenize_chat", boom)
    again = read_chat_jsonl(data, tok_dir, cache_dir=tmp_path / "cache")
    for a, b in zip(first.samples, again.samples):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)
        assert b.tokens.dtype == torch.int32 and b.loss_mask.dtype == torch.bool
    # a changed data file is a new key: tokenized again
    _write(data, CHATS[:1])
    with pytest.raises(AssertionError, match="tokenized again"):
        read_chat_jsonl(data, tok_dir, cache_dir=tmp_path / "cache")
    # the default cache lives beside the data file
    monkeypatch.undo()
    read_chat_jsonl(data, tok_dir)
    assert (tmp_path / "c.jsonl.odcfn-cache").is_dir()


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", r"c.jsonl:2: not valid JSON"),
        ('{"text": "hi"}', r"c.jsonl:2: expected an object with 'messages'"),
        ('{"messages": []}', r"c.jsonl:2: 'messages' must be a non-empty list"),
        ('{"messages": [{"role": "user", "content": 3}]}', r"c.jsonl:2: messages\[0\].content must be"),
        ('{"messages": [{"content": "x"}]}', r"messages\[0\].role must be a string"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', r"c.jsonl:2: messages has no 'assistant' turn"),
    ],
)
def test_bad_lines_are_named(tmp_path, tok_dir, line, match):
    with pytest.raises(ValueError, match=match):
        read_chat_jsonl(_write(tmp_path / "c.jsonl", CHATS[:1], [line]), tok_dir)


def test_bad_tokenizers_and_limits_are_named(tmp_path, tok_dir):
    data = _write(tmp_path / "c.jsonl", CHATS)
    bare = _tokenizer(tmp_path / "bare", template=None)
    with pytest.raises(ValueError, match="has no chat template"):
        read_chat_jsonl(data, bare)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_chat_jsonl(data, tmp_path / "nope")
    # a template that renders the last turn differently: prefixes do not extend
    last_differs = TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] }}{% if loop.last %}!{% endif %}")
    odd = _tokenizer(tmp_path / "odd", template=last_differs)
    with pytest.raises(ValueError, match=r"c.jsonl:1: the chat template does not render messages\[1\]"):
        read_chat_jsonl(data, odd)
    with pytest.raises(ValueError, match=r"c.jsonl:1: token id \d+ is outside the model's vocab_size=10"):
        read_chat_jsonl(data, tok_dir, vocab_size=10)
    short = read_chat_jsonl(data, tok_dir).samples[0].length  # the second conversation is longer
    with pytest.raises(ValueError, match=rf"c.jsonl:2: sample has \d+ tokens, more than max_length={short}"):
        read_chat_jsonl(data, tok_dir, max_length=short)
    with pytest.raises(ValueError, match="must be .jsonl"):
        read_chat_jsonl(tmp_path / "c.parquet", tok_dir)


def test_odcfn_train_on_chat_data(tmp_path, tok_dir):
    from odcfn import cli

    chats = [
        [{"role": "user", "content": CORPUS[i % 4]}, {"role": "assistant", "content": CORPUS[(i + 1) % 4]}]
        for i in range(8)
    ]
    _write(tmp_path / "chat.jsonl", chats)
    (tmp_path / "run.toml").write_text(
        'out_dir = "out"\n[model]\nvocab_size = 300\nd_model = 16\nn_layers = 1\nn_heads = 2\n'
        f'n_kv_heads = 1\nd_ff = 16\n[data]\npath = "chat.jsonl"\ntokenizer = "{tok_dir}"\n'
        'batch_size = 4\n[train]\nsteps = 2\nworld_size = 2\nlr = 1e-2\n'
    )
    assert cli.main(["train", "--config", str(tmp_path / "run.toml"), "--quiet"]) == 0
    recs = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(0 < r["loss_tokens"] < r["tokens"] / 2 for r in recs)  # prompts are not trained on
    assert (tmp_path / "chat.jsonl.odcfn-cache").is_dir()


def test_chat_training_on_two_thread_ranks_in_a_fresh_interpreter(tmp_path, tok_dir):
    """Ranks that are threads of one process used to import transformers at the same moment
    (a half-initialised module read as "not installed"): the data is tokenized once, before
    the ranks start. A fresh interpreter, as a user runs it: nothing imported beforehand."""
    import os
    import subprocess
    import sys

    _write(tmp_path / "chat.jsonl", [CHATS[i % 2] for i in range(4)])
    (tmp_path / "run.toml").write_text(
        'out_dir = "out"\n[model]\nvocab_size = 300\nd_model = 16\nn_layers = 1\nn_heads = 2\n'
        f'n_kv_heads = 1\nd_ff = 16\n[data]\npath = "chat.jsonl"\ntokenizer = "{tok_dir}"\n'
        'batch_size = 2\n[train]\nsteps = 1\nworld_size = 2\nbackend = "threads"\n[checkpoint]\nevery = 0\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "odcfn.cli", "train", "--config", str(tmp_path / "run.toml"), "--quiet"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "steps 0..1 on 2 rank(s)" in proc.stdout
