"""The RL loop: prompts, advantages, and one iteration of generate -> score -> update -> sync."""

from odcfn.rl.advantages import ESTIMATORS, advantages, token_advantages
from odcfn.rl.prompt import Prompt

__all__ = ["ESTIMATORS", "Prompt", "advantages", "token_advantages"]
