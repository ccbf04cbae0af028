"""The RL loop: prompts, advantages, and one iteration of generate -> score -> update -> sync."""

from odcfn.rl.prompt import Prompt

__all__ = ["Prompt"]
