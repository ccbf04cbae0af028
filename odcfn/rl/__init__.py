"""The RL loop: prompts, advantages, and one iteration of generate -> score -> update -> sync
(``odcfn.rl.step``)."""

from odcfn.data.prompt import Prompt
from odcfn.rl.advantages import ESTIMATORS, advantages, token_advantages
from odcfn.rl.config import RLConfig
from odcfn.rl.loop import RLMetrics, step

__all__ = ["ESTIMATORS", "Prompt", "RLConfig", "RLMetrics", "advantages", "step", "token_advantages"]
