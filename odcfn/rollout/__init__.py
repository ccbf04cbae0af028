"""Rollout engines: what generates an RL loop's samples (``LocalEngine``, ``VLLMEngine``)."""

from odcfn.rollout.base import Completion, Engine, SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
