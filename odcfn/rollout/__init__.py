"""Rollout engines: what generates an RL loop's samples (``LocalEngine``, ``VLLMEngine``)."""

from odcfn.rollout.base import Completion, Engine, SamplingParams
from odcfn.rollout.vllm_engine import VLLMEngine  # imports vllm only when an engine is built

__all__ = ["Completion", "Engine", "SamplingParams", "VLLMEngine"]
