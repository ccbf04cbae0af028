"""``odcfn.rewards``: the built-ins on tricky strings, ``score``'s refusal of failures by name,
batched rewards, ground-truth lookup, and rewards named as ``module:function``."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest
import torch

from odcfn import rewards
from odcfn.rewards import (
    ExactMatch,
    MissingTextError,
    RegexFormat,
    RewardError,
    answers_match,
    batched,
    extract_answer,
    ground_truth,
    resolve,
    score,
)
from odcfn.rl import Prompt
from odcfn.rollout import Completion


def comp(text: str | None, prompt_index: int = 0, n: int = 3) -> Completion:
    return Completion(prompt_index, torch.arange(n), torch.zeros(n), "stop", text=text)


def prompt(answer=None, text: str | None = "What is 6*7?", **fields) -> Prompt:
    if answer is not None:
        fields["answer"] = answer
    return Prompt((1, 2, 3), text=text, fields=fields)


# ---- extraction and matching -----------------------------------------------------------


@pytest.mark.parametrize(
    "text,want",
    [
        (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{a{b{c}}d}", "a{b{c}}d"),  # nested braces
        (r"first \boxed{1} then \boxed{x^{2}+1}", "x^{2}+1"),  # the last box
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces are not the box's
        (r"\fbox{7}", "7"),
        (r"\boxed 7$", "7"),
        (r"\boxed{-3} and later 99", "-3"),  # a box beats a later number
        (r"\boxed{12", None),  # an unclosed (truncated) box gives no answer, not a number
        (r"\boxed", None),
        ("x = -3", "-3"),
        ("5-3", "3"),  # a binary minus is not a sign
        ("(2)-3", "3"),
        ("total: 1,000 apples.", "1,000"),
        ("1,0000", "0000"),  # not a thousands group
        ("it is 42.0.", "42.0"),
        ("about .5 of it", ".5"),
        ("v2 has none", None),  # digits inside a word are not a number
        ("no answer here", None),
        ("", None),
    ],
)
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_extract_modes():
    t = r"3 apples, \boxed{4}, then 5"
    assert extract_answer(t, "boxed") == "4"
    assert extract_answer(t, "number") == "5"
    assert extract_answer("3 apples", "boxed") is None
    with pytest.raises(ValueError, match="unknown extract mode 'last': known ones are boxed_or_number, box"):
        extract_answer(t, "last")


@pytest.mark.parametrize(
    "pred,truth,same",
    [
        ("1,000", "1000", True),
        ("1,000", 1000, True),
        ("42.0", "42", True),
        ("42", 42.0, True),
        ("0.1", 0.1, True),  # a float truth is its decimal, not its binary expansion
        ("0.5", "1/2", True),
        (r"\frac{1}{2}", "0.5", True),
        (r"-\dfrac{3}{4}", "-0.75", True),
        ("- 3", "-3", True),
        ("$5$", "5", True),
        (r"\text{ 42 }.", "42", True),
        (r"50\%", "50", True),
        ("1e3", "1000", True),
        ("x + 1", "x+1", True),
        ("72", "Natalia sold 48/2 = 24 clips in May ... #### 72", True),  # GSM8K's solution text
        ("x^2", r"so \boxed{x^2}", True),  # a MATH-style boxed solution
        ("4", ["3", 4], True),  # a list of accepted answers
        ("-3", "3", False),
        ("42.5", "42", False),
        ("1,000", "100", False),
        ("1+x", "x+1", False),  # no algebra
        (None, "3", False),
        ("3/0", "3", False),
    ],
)
def test_answers_match(pred, truth, same):
    assert answers_match(pred, truth) is same


def test_exact_match_scores_and_format_credit():
    p = prompt("42")
    assert rewards.exact_match(p, comp(r"6*7 = \boxed{42}")) == 1.0
    assert rewards.exact_match(p, comp("6*7 = 42.0")) == 1.0  # the last number
    assert rewards.exact_match(p, comp(r"\boxed{41}")) == 0.0
    partial = ExactMatch(format_score=0.1)
    assert partial(p, comp(r"\boxed{41}")) == 0.1  # an answer in the format, but wrong
    assert partial(p, comp("no idea")) == 0.0  # no answer at all
    boxed_only = ExactMatch(extract="boxed", format_score=0.1, score=2.0)
    assert boxed_only(p, comp("6*7 = 42")) == 0.0  # right number, but not boxed
    assert boxed_only(p, comp(r"\boxed{42}")) == 2.0
    with pytest.raises(ValueError, match="ExactMatch.extract must be one of"):
        ExactMatch(extract="any")
    with pytest.raises(ValueError, match="ExactMatch.format_score must be a finite number, got nan"):
        ExactMatch(format_score=math.nan)


def test_ground_truth_lookup_reads_answer_then_verl_nested_or_dotted():
    assert ground_truth(prompt("7")) == "7"
    assert ground_truth(prompt(None, reward_model={"style": "rule", "ground_truth": "8"})) == "8"
    assert ground_truth(Prompt((1,), fields={"reward_model.ground_truth": "9"})) == "9"
    assert ground_truth(Prompt((1,), fields={"sol": {"final": "10"}}), "sol.final") == "10"
    with pytest.raises(KeyError, match=r"no ground truth under 'answer' or 'reward_model.ground_truth' "
                                       r"\(its fields: \['question'\]\)"):
        ground_truth(Prompt((1,), fields={"question": "?"}))
    r = ExactMatch(answer_key="sol.final")
    assert r(Prompt((1,), fields={"sol": {"final": "10"}}), comp(r"\boxed{10}")) == 1.0


def test_regex_format_full_match_or_search():
    think = RegexFormat(r"<think>.*</think>\s*<answer>.*</answer>")
    ok = "<think>\nsome\nlines\n</think>\n<answer> 42 </answer>\n"
    assert think(prompt(), comp(ok)) == 1.0  # DOTALL, and the trailing newline stripped
    assert think(prompt(), comp("preamble " + ok)) == 0.0  # a full match is the default
    assert RegexFormat(r"<answer>.*</answer>", mode="search", score=0.5)(prompt(), comp("x " + ok)) == 0.5
    assert RegexFormat(r"<think>", mode="match")(prompt(), comp(ok)) == 1.0
    assert RegexFormat(r"a.b", flags=0)(prompt(), comp("a\nb")) == 0.0
    assert RegexFormat(r"\d+", strip=False)(prompt(), comp("42\n")) == 0.0
    with pytest.raises(ValueError, match=r"RegexFormat.pattern '\(' is not a valid regular expression"):
        RegexFormat("(")
    with pytest.raises(ValueError, match="RegexFormat.mode must be one of"):
        RegexFormat("x", mode="find")


# ---- score -----------------------------------------------------------------------------


def test_score_applies_the_reward_in_completion_order():
    ps = [prompt("1", text="one"), prompt("2", text="two")]
    cs = [comp(r"\boxed{1}", 0), comp(r"\boxed{3}", 0), comp("2", 1), comp("no", 1)]
    got = score(rewards.exact_match, ps, cs)
    assert got.dtype == torch.float32 and got.tolist() == [1.0, 0.0, 1.0, 0.0]
    # prompt_indices overrides the completions' own (e.g. shares gathered from several ranks)
    assert score(rewards.exact_match, ps, cs, prompt_indices=[1, 1, 1, 1]).tolist() == [0.0, 0.0, 1.0, 0.0]
    # numpy scalars and one-element tensors are numbers too
    assert score(lambda p, c: np.float32(0.25), ps, cs[:1]).tolist() == [0.25]
    assert score(lambda p, c: torch.tensor(2), ps, cs[:1]).tolist() == [2.0]


def _boom(p, c):
    if c.text == "bad":
        raise ZeroDivisionError("division by zero")
    return 1.0


@pytest.mark.parametrize(
    "fn,msg",
    [
        (_boom, r"reward _boom raised on completion 2 \(of prompt 1 'What is 2\+2\?'\): "
                r"ZeroDivisionError: division by zero"),
        (lambda p, c: math.nan if c.text == "bad" else 0.0,
         r"returned nan for completion 2 \(of prompt 1 'What is 2\+2\?'\): a reward must be a finite real"),
        (lambda p, c: -math.inf if c.text == "bad" else 0.0, "returned -inf for completion 2"),
        (lambda p, c: None if c.text == "bad" else 0.0, "returned None for completion 2"),
        (lambda p, c: "1" if c.text == "bad" else 0.0, "returned '1' for completion 2"),
        (lambda p, c: c.text == "bad", "returned False for completion 0"),  # a bool is not a number
        (lambda p, c: torch.tensor([1.0, 2.0]), r"returned tensor\(\[1., 2.\]\) for completion 0"),
    ],
)
def test_a_failing_reward_names_prompt_and_completion(fn, msg):
    ps = [prompt("1", text="What is 1+1?"), prompt("4", text="What is 2+2?")]
    cs = [comp("ok", 0), comp("ok", 1), comp("bad", 1)]
    with pytest.raises(RewardError, match=msg) as e:
        score(fn, ps, cs)
    if fn is _boom:
        assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_a_prompt_without_text_is_named_by_index():
    with pytest.raises(RewardError, match=r"completion 0 \(of prompt 0\): KeyError"):
        score(rewards.exact_match, [Prompt((5, 6))], [comp("1")])


def test_missing_text_is_a_clear_error_and_decode_fills_it():
    ps = [prompt("42")]
    want = (r"completion 0 \(of prompt 0 .*\): MissingTextError: this reward reads the completion's "
            r"text, but the completion has none: the engine knows no tokenizer")
    with pytest.raises(RewardError, match=want) as e:
        score(rewards.exact_match, ps, [comp(None)])
    assert isinstance(e.value.__cause__, MissingTextError)
    vocab = {0: "4", 1: "2", 2: ""}
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    assert score(rewards.exact_match, ps, [comp(None)], decode=decode).tolist() == [1.0]


def test_batched_rewards_get_lists_and_are_checked_per_completion():
    calls = []

    @batched
    def lengths(prompts, completions):
        calls.append(len(completions))
        assert all(isinstance(p, Prompt) for p in prompts)
        return [float(c.length) for c in completions]

    assert rewards.is_batched(lengths) and lengths.__name__ == "lengths"
    ps = [prompt("1"), prompt("2")]
    cs = [comp("a", 0, n=1), comp("b", 0, n=2), comp("c", 1, n=3), comp("d", 1, n=4), comp("e", 1, n=5)]
    assert score(lengths, ps, cs).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0] and calls == [5]
    assert score(lengths, ps, cs, batch_size=2).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert calls[1:] == [2, 2, 1]
    # a tensor return is fine; so is an object with a batched attribute
    class Model:
        batched = True

        def __call__(self, prompts, completions):
            return torch.ones(len(completions))

    assert score(Model(), ps, cs).tolist() == [1.0] * 5

    with pytest.raises(RewardError, match=r"returned nan for completion 3 \(of prompt 1 'What is 6\*7\?'\)"):
        score(batched(lambda p, c: [0.0, 0.0, 0.0, math.nan, 0.0]), ps, cs)
    with pytest.raises(RewardError, match=r"returned 4 values for 5 completions"):
        score(batched(lambda p, c: [0.0] * 4), ps, cs)
    with pytest.raises(RewardError, match=r"returned float for completions 0..4"):
        score(batched(lambda p, c: 1.0), ps, cs)

    def broken(p, c):
        raise RuntimeError("model server down")

    want = r"batched reward .*<lambda> raised on completions 2..3 \(prompts \[1\]\): RuntimeError: model"
    with pytest.raises(RewardError, match=want):
        score(batched(lambda p, c: [0.0] * len(c) if c[0].length < 3 else broken(p, c)), ps, cs[:4],
              batch_size=2)


def test_score_refuses_bad_arguments_by_name():
    ps, cs = [prompt("1")], [comp("1")]
    with pytest.raises(TypeError, match="reward_fn must be callable"):
        score("exact_match", ps, cs)
    with pytest.raises(ValueError, match="completion 0 belongs to prompt 3, but there are only 1 prompts"):
        score(rewards.exact_match, ps, [comp("1", 3)])
    with pytest.raises(TypeError, match=r"prompts\[0\] must be an odcfn.rl.Prompt"):
        score(rewards.exact_match, [(1, 2)], cs)
    with pytest.raises(ValueError, match="prompt_indices has 2 entries for 1 completions"):
        score(rewards.exact_match, ps, cs, prompt_indices=[0, 0])


# ---- rewards named in a config ---------------------------------------------------------


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    src = textwrap.dedent(
        """
        import odcfn.rewards as R

        NOT_A_FUNCTION = 3

        def length_reward(prompt, completion):
            return float(completion.length)

        class Scorer:
            @staticmethod
            def one(prompt, completion):
                return 1.0

        @R.batched
        def all_half(prompts, completions):
            return [0.5] * len(completions)
        """
    )
    (tmp_path / "my_rewards_mod.py").write_text(src)
    (tmp_path / "needs_dep.py").write_text("import surely_not_installed_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_module_function_specs_load(reward_module):
    ps, cs = [prompt("1")], [comp("x", n=4)]
    fn = resolve("my_rewards_mod:length_reward")
    assert score(fn, ps, cs).tolist() == [4.0]
    assert score(resolve("my_rewards_mod:Scorer.one"), ps, cs).tolist() == [1.0]
    assert score(resolve("my_rewards_mod:all_half"), ps, cs).tolist() == [0.5]  # stays batched
    by_path = resolve(f"{reward_module / 'my_rewards_mod.py'}:length_reward")
    assert by_path(ps[0], cs[0]) == 4.0 and by_path is not fn  # a file is its own module
    assert resolve(f"{reward_module / 'my_rewards_mod.py'}:length_reward") is by_path  # imported once


@pytest.mark.parametrize(
    "spec,err,msg",
    [
        ("no_such_xyz:f", ValueError, r"reward 'no_such_xyz:f': no module named 'no_such_xyz'"),
        ("my_rewards_mod:missing", ValueError,
         r"reward 'my_rewards_mod:missing': 'my_rewards_mod' has no attribute 'missing'"),
        ("my_rewards_mod:Scorer.two", ValueError, r"'my_rewards_mod:Scorer' has no attribute 'two'"),
        ("my_rewards_mod:NOT_A_FUNCTION", TypeError,
         r"reward 'my_rewards_mod:NOT_A_FUNCTION' names a int, not a function"),
        ("/no/such/dir/r.py:f", ValueError, r"reward '/no/such/dir/r.py:f': no file '/no/such/dir/r.py'"),
        ("my_rewards_mod:", ValueError, "must be 'module:function' or 'path/to/file.py:function'"),
        ("exact", ValueError,
         "unknown reward 'exact': built-ins are exact_match, regex_format; name your own as 'module:func"),
    ],
)
def test_bad_specs_are_named(reward_module, spec, err, msg):
    with pytest.raises(err, match=msg):
        resolve(spec)


def test_a_missing_dependency_inside_the_module_is_not_blamed_on_the_spec(reward_module):
    with pytest.raises(ModuleNotFoundError, match="surely_not_installed_dep"):
        resolve("needs_dep:f")


def test_builtins_by_name_with_options():
    r = resolve("exact_match", format_score=0.1)
    assert isinstance(r, ExactMatch) and r.format_score == 0.1
    fmt = resolve("regex_format", pattern=r"\d+")
    assert fmt(prompt(), comp("123")) == 1.0
    with pytest.raises(TypeError, match="built-in reward 'regex_format'"):
        resolve("regex_format")
    with pytest.raises(ValueError, match="configure built-ins only"):
        resolve("my_mod:f", score=2)
    f = lambda p, c: 0.0  # noqa: E731
    assert resolve(f) is f
