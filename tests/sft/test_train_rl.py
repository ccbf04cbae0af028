"""``odcfn train`` with ``train.task = "rl"``, before any rank starts: the ``[rollout]`` / ``[rl]``
keys checked when the file is read, the prompts file in TRL's prompt-only format (text or chat
messages, JSONL or parquet, ``answer`` or verl's nested ``reward_model.ground_truth``), and every
bad row named by ``file:line`` and key."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from odcfn import cli
from odcfn.data.chat import load_tokenizer
from odcfn.data.prompts import get_field, read_prompts
from odcfn.sft.config import config_from_dict, load_config
from odcfn.sft.prepare import prepare_data

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "chat" / "tokenizer"  # shipped: no download
EOS = 2  # <|im_end|> in that tokenizer


def _rows(n: int = 8) -> list[dict]:
    return [{"prompt": f"{i % 5} + {i % 3} =", "answer": str(i % 5 + i % 3)} for i in range(n)]


def _setup(tmp: Path, *, rows: list[dict] | None = None, name: str = "prompts.jsonl", rl: str = "",
           rollout: str = "", data: str = "", train: str = "") -> Path:
    path = tmp / name
    rows = _rows() if rows is None else rows
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp / "run.toml"
    cfg.write_text(
        'out_dir = "out"\n[model]\nvocab_size = 300\nd_model = 32\nn_layers = 2\nn_heads = 4\n'
        f'n_kv_heads = 2\nd_ff = 64\n[data]\npath = "{name}"\ntokenizer = "{TOKENIZER}"\n'
        f'batch_size = 4\n{data}[train]\ntask = "rl"\nsteps = 2\nworld_size = 2\n{train}'
        f"[rollout]\nmax_tokens = 8\nmax_model_len = 32\n{rollout}[rl]\n{rl or 'group_size = 2'}\n"
    )
    return cfg


def _fail(cfg: Path, capsys) -> str:
    assert cli.main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# --- the prompts file -------------------------------------------------------------------------


def test_text_prompts_are_tokenized_as_they_are_and_chat_prompts_through_the_template(tmp_path):
    tok = load_tokenizer(TOKENIZER)
    msgs = [{"role": "user", "content": "2 + 3?"}]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "2 + 3 =", "answer": "5"}) + "\n"
                    + json.dumps({"prompt": msgs, "answer": 5, "id": 7}) + "\n")
    data = read_prompts(path, tok, vocab_size=300, required_fields=[("answer", "reward_model.ground_truth")])
    plain, chat = data.prompts
    assert list(plain.tokens) == tok("2 + 3 =", add_special_tokens=False)["input_ids"]  # no special tokens
    assert plain.text == "2 + 3 =" and plain.fields == {"answer": "5"}
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")  # ends where the answer begins
    assert chat.text == text and list(chat.tokens) == tok(text, add_special_tokens=False)["input_ids"]
    assert chat.fields == {"answer": 5, "id": 7}
    assert data.where == (f"{path}:1", f"{path}:2")


def test_parquet_rows_with_verls_nested_ground_truth(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{i} + 1?"}], "data_source": "toy",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(4)]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    data = read_prompts(path, TOKENIZER, required_fields=[("answer", "reward_model.ground_truth")])
    assert [get_field(p.fields, "reward_model.ground_truth") for p in data.prompts] == ["1", "2", "3", "4"]
    assert data.prompts[2].fields["data_source"] == "toy" and data.where[2] == f"{path}: row 2"
    # a flattened column of the dotted name serves too
    assert get_field({"reward_model.ground_truth": "9"}, "reward_model.ground_truth") == "9"


@pytest.mark.parametrize(("row", "expect"), [
    ({"answer": "1"}, ":3: no 'prompt' key (the row has ['answer'])"),
    ({"prompt": "", "answer": "1"}, ":3: 'prompt' is empty"),
    ({"prompt": "   ", "answer": "1"}, ":3: 'prompt' is empty"),
    ({"prompt": [], "answer": "1"}, ":3: 'prompt' is an empty list of messages: an empty prompt"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, ":3: prompt[0] must be an object with string 'role'"),
    ({"prompt": 5, "answer": "1"}, ":3: 'prompt' must be text or a list of chat messages, got int"),
    ({"prompt": "1 + 1 ="}, ":3: no 'answer' or 'reward_model.ground_truth' field, which the reward reads"),
    ({"prompt": "1 + 1 =", "reward_model": {"style": "rule"}}, ":3: no 'answer' or 'reward_model.ground"),
    ({"prompt": "1 + 1 =" * 40, "answer": "2"},
     ":3: 'prompt' has 280 tokens; the engine's maximum length is 64"),
])
def test_bad_rows_are_named_by_file_line_and_key(tmp_path, row, expect):
    rows = _rows(4)
    rows[2] = row
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as e:
        read_prompts(path, TOKENIZER, vocab_size=300, max_model_len=64,
                     required_fields=[("answer", "reward_model.ground_truth")])
    assert str(e.value).startswith(f"{path}{expect}"), str(e.value)


def test_a_token_outside_the_vocabulary_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "abc", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: 'prompt' has token id \d+, outside the model's vocab"):
        read_prompts(path, TOKENIZER, vocab_size=10)


# --- through odcfn train's config -----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_the_run_reads_its_prompts_and_draws_them_per_iteration(tmp_path, fmt):
    cfg = load_config(_setup(tmp_path, rows=_rows(10), name=f"prompts.{fmt}"))
    assert cfg.train.task == "rl" and cfg.rl.group_size == 2 and cfg.rollout.max_tokens == 8
    data = prepare_data(cfg, 300)
    assert len(data.dataset) == 10 and data.per_epoch == 2  # 10 prompts, 4 per iteration
    first = [data.batch(k, cfg.data) for k in range(4)]
    assert all(len(b) == 4 for b in first)
    assert len({p.tokens for b in first[:2] for p in b}) >= 5  # an epoch: distinct rows
    assert [p.tokens for p in data.batch(3, cfg.data)] == [p.tokens for p in first[3]]  # a function of k


def test_prompts_too_long_are_named_or_dropped(tmp_path, capsys):
    rows = _rows(9)
    rows[4] = {"prompt": "1 + 1 =" * 10, "answer": "2"}  # 70 tokens > max_model_len 32
    cfg = _setup(tmp_path, rows=rows)
    err = _fail(cfg, capsys)
    assert "prompts.jsonl:5: 'prompt' has 70 tokens; the engine's maximum length rollout.max_model_len = 32" \
        in err and 'data.long_samples = "drop"' in err
    c = load_config(_setup(tmp_path, rows=rows, data='long_samples = "drop"\n'))
    data = prepare_data(c, 300)
    assert len(data.dataset) == 8 and data.dropped == (f"{tmp_path / 'prompts.jsonl'}:5",)
    # the microbatch cap bounds prompt + response
    c = load_config(_setup(tmp_path, train="max_tokens_per_microbatch = 12\n"))
    with pytest.raises(ValueError, match=r"prompts\.jsonl:1: 'prompt' has 7 tokens: with rollout.max_tokens "
                                         r"= 8 a sample may reach 15, more than "
                                         r"train.max_tokens_per_microbatch"):
        prepare_data(c, 300)


def test_a_missing_reward_field_is_named_before_any_rank_starts(tmp_path, capsys):
    rows = _rows(8)
    rows[5] = {"prompt": "2 + 2 ="}
    err = _fail(_setup(tmp_path, rows=rows), capsys)
    assert "prompts.jsonl:6: no 'answer' or 'reward_model.ground_truth' field, which rl.reward = " \
           "'exact_match' reads" in err
    rows[5] = {"prompt": "2 + 2 =", "answer": "4"}
    err = _fail(_setup(tmp_path, rows=rows, rl='reward_fields = ["level"]\n'), capsys)
    assert "prompts.jsonl:1: no 'level' field" in err
    # a custom answer key
    rows = [{"prompt": r["prompt"], "sol": r["answer"]} for r in _rows(8)]
    cfg = load_config(_setup(tmp_path, rows=rows, rl='reward_options = {answer_key = "sol"}\n'))
    assert len(prepare_data(cfg, 300).dataset) == 8


@pytest.mark.parametrize(("edit", "expect"), [
    ({"rollout": 'engine = "sglang"\n'}, "rollout.engine must be one of ['local', 'vllm'], got 'sglang'"),
    ({"rl": 'estimator = "ppo"\n'}, "rl.estimator must be one of ['grpo', 'rloo', 'reinforce_plus_plus'"),
    ({"rl": "group_size = 1\n"}, 'rl.group_size = 1: rl.estimator = "grpo" needs at least 2 completions'),
    ({"rl": 'reward = "no_such_reward"\n'}, "rl.reward: unknown reward 'no_such_reward': built-ins are"),
    ({"rl": 'reward = "no_such_module_xyz:fn"\n'}, "rl.reward: reward 'no_such_module_xyz:fn': no module"),
    ({"rl": 'reward_options = {nope = 1}\n'}, "rl.reward_options: built-in reward 'exact_match'"),
    ({"rl": 'kl_loss_type = "kl3"\n'}, "rl.kl_loss_type must be one of ['kl', 'k1',"),
    ({"rl": 'loss_agg_mode = "sum"\n'}, "rl.loss_agg_mode must be one of ['token-mean',"),
    ({"rl": "ppo_epochs = 0\n"}, "rl.ppo_epochs must be an integer >= 1, got 0"),
    ({"rl": "overlong_buffer_len = 8\n"}, "rl.overlong_buffer_len = 8 must be below rollout.max_tokens = 8"),
    ({"rl": "max_version_lag = 2\n"}, "rl.max_version_lag is set but rl.async_rollouts is false"),
    ({"rl": "rollout_is_threshold = 0\n"}, "rl.rollout_is_threshold must be a number > 0 (or unset), got 0"),
    ({"rollout": "top_p = 1.5\n"}, "rollout.top_p must be a number > 0 and <= 1, got 1.5"),
    ({"rollout": "stop_token_ids = [2, -1]\n"}, "rollout.stop_token_ids must be a list of token ids >= 0"),
    ({"rollout": "engine_options = {dtype = \"float32\"}\n"},
     "rollout.engine_options is for rollout.engine"),
    ({"train": "staleness = 1\n", "rl": "kl_loss_coef = 0.1\n"},
     "train.staleness = 1 cannot be combined with rl.kl_loss_coef = 0.1 yet"),
    ({"data": 'long_samples = "truncate"\n'},
     'data.long_samples = "truncate" cannot serve train.task = "rl"'),
])
def test_bad_keys_end_in_one_line_naming_the_file_and_the_key(tmp_path, capsys, edit, expect):
    cfg = _setup(tmp_path, **edit)
    err = _fail(cfg, capsys)
    assert err.startswith(f"odcfn train: error: {cfg}: config: ") and expect in err, err


def test_vllm_without_the_extra_says_how_to_install_it(tmp_path, capsys):
    import importlib.util

    assert importlib.util.find_spec("vllm") is None  # the test machine's environment
    err = _fail(_setup(tmp_path, rollout='engine = "vllm"\n'), capsys)
    assert 'rollout.engine = "vllm" but vLLM is not installed: pip install "odcfn[vllm]"' in err


def test_rl_keys_with_another_task_and_a_task_without_tokenizer_are_refused():
    base = {"data": {"path": "p.jsonl", "tokenizer": "tok"}, "train": {"steps": 1, "world_size": 1}}
    with pytest.raises(ValueError, match=r'rl\.group_size is set but train\.task is "sft", which ignores'):
        config_from_dict({**base, "rl": {"group_size": 8}})
    with pytest.raises(ValueError, match=r'rollout\.max_tokens is set but train\.task is "dpo"'):
        config_from_dict({**base, "train": {"steps": 1, "task": "dpo"}, "rollout": {"max_tokens": 8}})
    with pytest.raises(ValueError, match=r'dpo\.beta is set but train\.task is "rl"'):
        config_from_dict({**base, "train": {"steps": 1, "task": "rl"}, "dpo": {"beta": 0.5}})
    with pytest.raises(ValueError, match=r'train\.task = "rl" needs data\.tokenizer'):
        config_from_dict({"data": {"path": "p.jsonl"}, "train": {"steps": 1, "task": "rl"}})


def test_the_sections_become_the_loops_rl_config():
    from odcfn.sft.config_rl import rl_config, task_loss

    cfg = config_from_dict({
        "data": {"path": "p.jsonl", "tokenizer": "tok"}, "train": {"steps": 1, "task": "rl", "world_size": 1},
        "rollout": {"temperature": 0.7, "top_k": 5, "max_tokens": 16},
        "rl": {"group_size": 3, "estimator": "rloo", "kl_loss_coef": 0.05, "clip_ratio_high": 0.28,
               "async_rollouts": True, "max_version_lag": 2, "seed": 9, "dynamic_sampling": True},
    })
    rc = rl_config(cfg, lambda p, c: 0.0, EOS)
    s, loss = rc.sampling, rc.loss
    assert (s.max_tokens, s.temperature, s.top_k, s.stop_token_ids, s.n) == (16, 0.7, 5, (EOS,), 3)
    got = (rc.group_size, rc.estimator, rc.seed, rc.max_version_lag, rc.dynamic_sampling)
    assert got == (3, "rloo", 9, 2, True)
    assert loss.decoupled and loss.temperature == 0.7 and loss.kl_loss_coef == 0.05 and rc.needs_ref
    assert loss.clip_ratio_high == 0.28 and task_loss(cfg) == loss
    explicit = config_from_dict({**{"data": {"path": "p.jsonl", "tokenizer": "tok"}},
                                 "train": {"steps": 1, "task": "rl", "world_size": 1},
                                 "rollout": {"stop_token_ids": [5, 6], "temperature": 0.0}})
    rc = rl_config(explicit, "exact_match", EOS)
    assert rc.sampling.stop_token_ids == (5, 6) and rc.loss.temperature == 1.0  # greedy: log-probs at T=1
