from odcfn.models.hf import from_hf, shard_from_hf, to_hf
from odcfn.models.qwen import QwenConfig, QwenModule, init_params, qwen_model

__all__ = ["QwenConfig", "QwenModule", "from_hf", "init_params", "qwen_model", "shard_from_hf", "to_hf"]
