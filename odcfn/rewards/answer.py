"""Exact match of a final answer: the last ``\\boxed{...}`` of the completion (nested braces
allowed), or else its last number, compared with the row's ground truth.

Two answers match when both read as numbers and are equal as exact rationals ("1,000" = "1000",
"42.0" = "42", "0.5" = "1/2" = "\\frac{1}{2}", "-3" = "- 3"), or else when they are the same
string up to whitespace and light LaTeX dressing (``$``, ``\\text{}``, ``\\left``/``\\right``,
thin spaces, a trailing period). There is no symbolic algebra: "x+1" and "1+x" differ.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from odcfn._check import ArgTypeError, check_number
from odcfn.data.prompt import Prompt
from odcfn.rewards.base import completion_text, ground_truth
from odcfn.rollout.base import Completion

__all__ = [
    "EXTRACT_MODES",
    "ExactMatch",
    "answers_match",
    "exact_match",
    "extract_answer",
    "last_boxed",
    "last_number",
    "normalize_answer",
    "parse_number",
]

EXTRACT_MODES = ("boxed_or_number", "boxed", "number")

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# a number in running text: a sign only where it cannot be a binary minus ("5-3" gives 3),
# thousands groups of exactly three digits, an optional decimal part
_TEXT_NUMBER = re.compile(
    r"(?<![\w.])(?:(?<![\w)\]}])[-+])?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
)
_DECIMAL = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_SLASH = re.compile(r"([-+]?\d+)/(\d+)")
_FRAC = re.compile(r"([-+]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces
    balanced (``\\{`` and ``\\}`` are characters, not braces); ``\\boxed 42`` (no braces) gives
    the next word. None when there is no box, or the last one is never closed (a truncated
    completion gives no answer rather than an earlier one)."""
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    i = boxes[-1].end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        word = re.match(r"[^\s$]+", text[i:])
        return word.group(0) if word else None
    depth, start, i = 0, i + 1, i
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped character, e.g. \{ : never a brace of the box
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def last_number(text: str) -> str | None:
    """The last number written in ``text`` ("-3", "1,000", "2.5"), or None."""
    found = _TEXT_NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(text: str, mode: str = "boxed_or_number") -> str | None:
    """The final answer of ``text``: ``"boxed"``: the last box's content; ``"number"``: the last
    number; ``"boxed_or_number"``: the last box if the text has one (even an unclosed one, which
    gives None), else the last number."""
    if mode not in EXTRACT_MODES:
        raise ValueError(f"unknown extract mode {mode!r}: known ones are {', '.join(EXTRACT_MODES)}")
    if mode == "number":
        return last_number(text)
    if mode == "boxed" or _BOX.search(text):
        return last_boxed(text)
    return last_number(text)


def _undress(s: str) -> str:
    """``s`` without the LaTeX and punctuation that do not change an answer."""
    s = s.strip()
    prev = None
    while prev != s:  # peel nested wrappers: "$\text{ 42 }$."
        prev = s
        s = s.strip().rstrip(".").strip()
        if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
            s = s[1:-1]
        s = _TEXT_CMD.sub(r"\1", s)
    for cmd in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle"):
        s = s.replace(cmd, "")
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s)  # degrees
    s = re.sub(r"\\?%$", "", s.strip())  # a trailing percent sign
    return re.sub(r"\s+", "", s)


def parse_number(s: Any) -> Fraction | None:
    """``s`` as an exact rational when it is a number: an int or float, or a string like
    "1,000", "-42.0", "+3", ".5", "1e3", "3/4", "\\frac{3}{4}" or "-\\dfrac{3}{4}" (after
    removing the dressing ``normalize_answer`` removes). None otherwise."""
    if isinstance(s, bool):
        return None
    if isinstance(s, int):
        return Fraction(s)
    if isinstance(s, float):
        return Fraction(repr(s)) if s == s and abs(s) != float("inf") else None  # 0.1 is 1/10, not binary
    if not isinstance(s, str):
        return None
    s = _undress(s)
    if _DECIMAL.fullmatch(s):
        return Fraction(s.replace(",", ""))
    m = _SLASH.fullmatch(s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    m = _FRAC.fullmatch(s)
    if m:
        num, den = parse_number(m.group(2)), parse_number(m.group(3))
        if num is not None and den:
            return -num / den if m.group(1) == "-" else num / den
    return None


def normalize_answer(s: Any) -> str:
    """A canonical string for an answer: a number's reduced rational ("1,000.0" -> "1000",
    "0.50" -> "1/2"), else the text without whitespace and LaTeX dressing."""
    n = parse_number(s)
    if n is not None:
        return str(n)
    return _undress(str(s))


def _truth_text(t: Any) -> Any:
    # a GSM8K-style worked solution ends "#### 72"; a MATH-style one boxes its answer
    if isinstance(t, str):
        if "####" in t:
            return t.rsplit("####", 1)[1]
        if _BOX.search(t):
            boxed = last_boxed(t)
            return t if boxed is None else boxed
    return t


def answers_match(predicted: str | None, truth: Any) -> bool:
    """Whether ``predicted`` equals ``truth`` (a str or number, or a list of accepted answers):
    as numbers when both are numbers, else as normalised strings."""
    if predicted is None:
        return False
    if isinstance(truth, (list, tuple)):
        return any(answers_match(predicted, t) for t in truth)
    truth = _truth_text(truth)
    p, t = parse_number(predicted), parse_number(truth)
    if p is not None and t is not None:
        return p == t
    return normalize_answer(predicted) == normalize_answer(truth)


class ExactMatch:
    """Reward ``score`` when the completion's final answer (``extract_answer``) equals the
    ground truth, ``format_score`` when an answer was found but is wrong (partial credit for the
    format, as verl's math rewards give), 0.0 when no answer was found.

    ``answer_key``: the field holding the ground truth (default: ``answer``, then verl's
    ``reward_model.ground_truth``). ``extract``: one of ``EXTRACT_MODES``; with ``"boxed"`` only
    a boxed answer counts, so ``format_score`` rewards boxing.
    """

    def __init__(
        self,
        *,
        answer_key: str | None = None,
        extract: str = "boxed_or_number",
        score: float = 1.0,
        format_score: float = 0.0,
    ) -> None:
        if answer_key is not None and not isinstance(answer_key, str):
            raise ArgTypeError(
                f"ExactMatch.answer_key must be a str or None, got {type(answer_key).__name__}"
            )
        if extract not in EXTRACT_MODES:
            raise ValueError(f"ExactMatch.extract must be one of {EXTRACT_MODES}, got {extract!r}")
        self.answer_key = answer_key
        self.extract = extract
        self.score = check_number(score, "ExactMatch.score")
        self.format_score = check_number(format_score, "ExactMatch.format_score")
        self.__qualname__ = self.__name__ = "exact_match"

    def __call__(self, prompt: Prompt, completion: Completion) -> float:
        truth = ground_truth(prompt, self.answer_key)
        answer = extract_answer(completion_text(completion), self.extract)
        if answer is None:
            return 0.0
        return self.score if answers_match(answer, truth) else self.format_score

    def __repr__(self) -> str:
        return (
            f"ExactMatch(answer_key={self.answer_key!r}, extract={self.extract!r}, "
            f"score={self.score}, format_score={self.format_score})"
        )


exact_match = ExactMatch()

