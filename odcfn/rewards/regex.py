"""A format reward: whether the completion's text matches a regular expression."""

from __future__ import annotations

import re

from odcfn._check import ArgTypeError, check_number
from odcfn.data.prompt import Prompt
from odcfn.rewards.base import completion_text
from odcfn.rollout.base import Completion

__all__ = ["MATCH_MODES", "RegexFormat"]

MATCH_MODES = ("fullmatch", "match", "search")


class RegexFormat:
    """Reward ``score`` when the completion's text matches ``pattern``, else 0.0.

    ``mode``: ``"fullmatch"`` (the whole text, the default), ``"match"`` (a prefix) or
    ``"search"`` (anywhere). ``flags``: ``re`` flags, by default ``re.DOTALL`` so that ``.``
    crosses the newlines of a multi-line answer. ``strip``: match the text without its leading
    and trailing whitespace (a completion often ends with a newline), True by default.
    """

    def __init__(
        self,
        pattern: str,
        *,
        mode: str = "fullmatch",
        flags: int = re.DOTALL,
        score: float = 1.0,
        strip: bool = True,
    ) -> None:
        if not isinstance(pattern, str):
            raise ArgTypeError(f"RegexFormat.pattern must be a str, got {type(pattern).__name__}")
        if mode not in MATCH_MODES:
            raise ValueError(f"RegexFormat.mode must be one of {MATCH_MODES}, got {mode!r}")
        if isinstance(flags, bool) or not isinstance(flags, int):
            raise ArgTypeError(f"RegexFormat.flags must be re flags (an int), got {type(flags).__name__}")
        if not isinstance(strip, bool):
            raise ArgTypeError(f"RegexFormat.strip must be a bool, got {type(strip).__name__}")
        try:
            self.regex = re.compile(pattern, flags)
        except re.error as e:
            raise ValueError(f"RegexFormat.pattern {pattern!r} is not a valid regular expression: {e}") from e
        self.pattern, self.mode, self.strip = pattern, mode, strip
        self.score = check_number(score, "RegexFormat.score")
        self.__qualname__ = self.__name__ = "regex_format"

    def __call__(self, prompt: Prompt, completion: Completion) -> float:
        text = completion_text(completion)
        if self.strip:
            text = text.strip()
        found = getattr(self.regex, self.mode)(text)
        return self.score if found is not None else 0.0

    def __repr__(self) -> str:
        return f"RegexFormat({self.pattern!r}, mode={self.mode!r}, score={self.score}, strip={self.strip})"
