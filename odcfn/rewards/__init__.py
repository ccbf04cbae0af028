"""Rewards for RL: a reward function is ``fn(prompt, completion) -> float`` (``prompt`` an
``odcfn.rl.Prompt``, ``completion`` an ``odcfn.rollout.Completion``), or a ``@batched`` one on
lists; ``score`` applies one and refuses failures and non-finite values by name.

Built-ins: ``exact_match`` / ``ExactMatch`` (the final answer, boxed or the last number, against
the row's ground truth, with a format-reward option) and ``RegexFormat``. ``resolve`` turns a
config's ``"exact_match"``, ``"module:function"`` or ``"path/to/file.py:function"`` into one.
"""

from odcfn.rewards.answer import (
    ExactMatch,
    answers_match,
    exact_match,
    extract_answer,
    last_boxed,
    last_number,
    normalize_answer,
    parse_number,
)
from odcfn.rewards.base import (
    GROUND_TRUTH_KEYS,
    MissingTextError,
    RewardError,
    batched,
    completion_text,
    field,
    ground_truth,
    is_batched,
    score,
)
from odcfn.rewards.load import BUILTINS, load_function, resolve
from odcfn.rewards.regex import RegexFormat

__all__ = [
    "BUILTINS",
    "GROUND_TRUTH_KEYS",
    "ExactMatch",
    "MissingTextError",
    "RegexFormat",
    "RewardError",
    "answers_match",
    "batched",
    "completion_text",
    "exact_match",
    "extract_answer",
    "field",
    "ground_truth",
    "is_batched",
    "last_boxed",
    "last_number",
    "load_function",
    "normalize_answer",
    "parse_number",
    "resolve",
    "score",
]
