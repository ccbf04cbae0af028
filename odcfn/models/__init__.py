from odcfn.models.hf import config_from_hf, config_to_hf, from_hf, shard_from_hf, to_hf
from odcfn.models.hf_names import hf_state_dict
from odcfn.models.qwen import QwenConfig, QwenModule, QwenMoeConfig, init_params, qwen_model
from odcfn.models.rope import RopeScaling

__all__ = [
    "QwenConfig",
    "QwenModule",
    "QwenMoeConfig",
    "RopeScaling",
    "config_from_hf",
    "config_to_hf",
    "from_hf",
    "hf_state_dict",
    "init_params",
    "qwen_model",
    "shard_from_hf",
    "to_hf",
]
