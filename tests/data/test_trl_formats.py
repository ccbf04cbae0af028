"""TRL's dataset formats give the same token ids and loss masks here as TRL's own preprocessing of
the same rows, with the installed trl (1.16) and the same local tokenizer: every format, in its
standard and its conversational form, through ``odcfn train``'s readers (a JSONL file read by
``odcfn.data.readers`` / ``odcfn.data.prompts``).

TRL's side is its trainers' own dataset preparation: ``SFTTrainer._prepare_dataset`` and
``DPOTrainer._prepare_dataset`` (called with a stand-in for the few trainer attributes they
read: building a trainer needs a model and an accelerator, and the preparation does not use
them) and ``GRPOTrainer._tokenize_prompts``. A TRL label of -100 is a token without loss; a
DPO row's targets are its ``chosen_ids`` / ``rejected_ids`` after the shared ``prompt_ids``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import trl
from transformers import AutoTokenizer
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.sft_trainer import SFTTrainer

from odcfn.data.preference import read_preference_jsonl
from odcfn.data.prompts import read_prompts
from odcfn.data.readers import read_sft

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
S = lambda c: {"role": "system", "content": c}  # noqa: E731

# a Llama-style template: BOS written by the template, the assistant's output marked for TRL's
# assistant_only_loss right after the generation prompt
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


CHAT = [S("be short"), U("hi"), A("hello there"), U("the cat?"), A("the cat sat on the mat")]


def _bos_tokenizer(path: Path, template: str) -> Path:
    """A BPE tokenizer that adds a BOS to plain text (as Llama's does), so that TRL's special
    tokens rule (text: with them; conversations: the template's) is visible in the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.data.test_chat_data import CORPUS

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>",
                            chat_template=template).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen2.5-training", "bos"])
def tok_dir(request, tmp_path_factory):
    """TRL's own Qwen2.5 training template (``{% generation %}`` marks after ``<|im_start|>assistant``)
    on a ChatML tokenizer, and a BOS-adding tokenizer with a Llama-style template."""
    from tests.data.test_chat_data import _tokenizer

    root = tmp_path_factory.mktemp("tok") / request.param
    if request.param == "bos":
        return _bos_tokenizer(root, BOS_TEMPLATE)
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5_training.jinja").read_text()
    return _tokenizer(root, template=template)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trl_sft(tok, rows: list[dict], *, assistant_only: bool = False) -> list[tuple[list[int], list[bool]]]:
    me = SimpleNamespace(_tokenizer=tok, completion_only_loss=True, chat_template=None)
    args = SimpleNamespace(dataset_num_proc=None, dataset_text_field="text", max_length=None,
                           assistant_only_loss=assistant_only, shuffle_dataset=False)
    out = SFTTrainer._prepare_dataset(me, datasets.Dataset.from_list(rows), tok, args, False, None, "train")
    return [(r["input_ids"], [label != -100 for label in r["labels"]]) for r in out]


def _trl_dpo(tok, rows: list[dict]) -> list[tuple[list[int], list[bool]]]:
    me = SimpleNamespace(_tokenizer=tok)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    out = DPOTrainer._prepare_dataset(me, datasets.Dataset.from_list(rows), tok, args, "train")
    members = []
    for r in out:
        for k in ("chosen_ids", "rejected_ids"):
            ids = r["prompt_ids"] + r[k]
            members.append((ids, [i >= len(r["prompt_ids"]) for i in range(len(ids))]))
    return members


def _ours(samples) -> list[tuple[list[int], list[bool]]]:
    return [(s.tokens.tolist(), s.loss_mask.tolist()) for s in samples]


def _same(ours, theirs):
    assert len(ours) == len(theirs)
    for k, ((ids, mask), (tids, tmask)) in enumerate(zip(ours, theirs)):
        assert ids == tids, f"row {k}: token ids differ"
        # the first token is never a target (nothing predicts it): only the rest is compared
        assert mask[1:] == tmask[1:], f"row {k}: loss masks differ"
        assert any(mask[1:])


SFT_ROWS = {
    "text": [{"text": "the cat sat on the mat"}, {"text": "two plus two is four<|im_end|>"}],
    "prompt_completion": [{"prompt": "two plus", "completion": " two is four"},
                          {"prompt": "the cat sat", "completion": " on the mat"},
                          {"prompt": "hello there, how", "completion": " are you?"}],
    "prompt_completion_chat": [{"prompt": [U("two plus two?")], "completion": [A("four")]},
                               {"prompt": [S("be short"), U("hi"), A("hello there"), U("the cat?")],
                                "completion": [A("the cat sat on the mat")]}],
}


@pytest.mark.parametrize("fmt", sorted(SFT_ROWS))
def test_sft_formats_equal_trls_sft_trainer(tok_dir, tmp_path, fmt):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    rows = SFT_ROWS[fmt]
    data = read_sft(_jsonl(tmp_path / "d.jsonl", rows), tok_dir)
    _same(_ours(data.samples), _trl_sft(tok, rows))


def test_messages_equal_trls_assistant_only_loss(tok_dir, tmp_path):
    """TRL trains on the assistant's turns with ``assistant_only_loss`` (its default trains on
    every token, system and user turns included); odcfn's chat reader trains on them always."""
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    rows = [{"messages": [U("two plus two?"), A("four")]}, {"messages": CHAT}]
    data = read_sft(_jsonl(tmp_path / "m.jsonl", rows), tok_dir)
    _same(_ours(data.samples), _trl_sft(tok, rows, assistant_only=True))


def test_unmarked_templates_find_the_same_assistant_spans(tmp_path):
    """A template without ``{% generation %}`` marks (most models' own): odcfn finds each assistant
    turn from the template's renderings, and finds what TRL's marks say on the marked twin."""
    from odcfn.data.chat import tokenize_chat

    marked = AutoTokenizer.from_pretrained(str(_bos_tokenizer(tmp_path / "marked", BOS_TEMPLATE)))
    plain_template = BOS_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    plain = AutoTokenizer.from_pretrained(str(_bos_tokenizer(tmp_path / "plain", plain_template)))
    rows = [{"messages": CHAT}]
    _same(_ours([tokenize_chat(plain, rows[0]["messages"])]), _trl_sft(marked, rows, assistant_only=True))


PAIRS = {
    "standard": [{"prompt": "two plus two is", "chosen": " four", "rejected": " the cat"},
                 {"prompt": "the cat sat on", "chosen": " the mat", "rejected": " two"}],
    "conversational": [{"prompt": [U("two plus two?")], "chosen": [A("four")], "rejected": [A("the cat")]},
                       {"prompt": [S("be short"), U("hi"), A("hello there"), U("cat?")],
                        "chosen": [A("the cat sat on the mat")], "rejected": [A("fine, thanks!")]}],
    "implicit standard": [{"chosen": "two plus two is four", "rejected": "two plus two is the cat"},
                          {"chosen": "hello there, fine", "rejected": "hello there, how are you?"}],
    "implicit conversational": [{"chosen": [U("two plus two?"), A("four")],
                                 "rejected": [U("two plus two?"), A("the cat")]},
                                {"chosen": [U("hi"), A("hello there"), U("cat?"), A("the mat")],
                                 "rejected": [U("hi"), A("hello there"), U("cat?"), A("two")]}],
}


@pytest.mark.parametrize("form", sorted(PAIRS))
def test_preference_formats_equal_trls_dpo_trainer(tok_dir, tmp_path, form):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    rows = PAIRS[form]
    pairs = read_preference_jsonl(_jsonl(tmp_path / "p.jsonl", rows), tok_dir)
    _same(_ours([s for pair in pairs for s in pair]), _trl_dpo(tok, rows))


def test_prompt_only_equals_trls_grpo_trainer(tok_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    me = SimpleNamespace(_is_vlm=False, environment_factories=None, processing_class=tok, chat_template=None,
                         tools=None, chat_template_kwargs={})
    for rows in ([{"prompt": "two plus two is", "answer": "four"}, {"prompt": "the cat", "answer": "sat"}],
                 [{"prompt": [U("two plus two?")], "answer": "four"},
                  {"prompt": [S("be short"), U("hi"), A("hello there"), U("cat?")], "answer": "mat"}]):
        data = read_prompts(_jsonl(tmp_path / "r.jsonl", rows), tok)
        theirs = GRPOTrainer._tokenize_prompts(me, [r["prompt"] for r in rows])[0]
        assert [list(p.tokens) for p in data.prompts] == [list(t) for t in theirs]
        assert [dict(p.fields) for p in data.prompts] == [{"answer": r["answer"]} for r in rows]
