"""Rollout engines: what generates an RL loop's samples (``LocalEngine``, ``VLLMEngine``)."""

from odcfn.data.prompt import Prompt
from odcfn.rollout.base import Completion, Engine, SamplingParams
from odcfn.rollout.local import LocalEngine
from odcfn.rollout.vllm_engine import VLLMEngine

__all__ = ["Completion", "Engine", "LocalEngine", "Prompt", "SamplingParams", "VLLMEngine"]
