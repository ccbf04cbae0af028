from odcfn.models.qwen import QwenConfig, QwenModule, init_params, qwen_model

__all__ = ["QwenConfig", "QwenModule", "init_params", "qwen_model"]
