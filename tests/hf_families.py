"""Tiny Hugging Face models of every supported family, shared by the parity tests."""

from __future__ import annotations

import torch
import transformers

# tiny configs that differ from each other in every dimension that has a name
FAMILIES = {
    "qwen2": (
        "Qwen2",
        dict(vocab_size=53, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=24, rope_theta=5000.0),
    ),
    "qwen2-yarn": (
        "Qwen2",
        dict(vocab_size=41, hidden_size=24, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, intermediate_size=20, max_position_embeddings=32,
             rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                              "original_max_position_embeddings": 8}),
    ),
    "qwen3": (
        "Qwen3",
        dict(vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=10, intermediate_size=20, rope_theta=1e4),
    ),
    "qwen3-bias": (
        "Qwen3",
        dict(vocab_size=37, hidden_size=12, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=8, intermediate_size=28, attention_bias=True,
             rms_norm_eps=1e-5, rope_theta=3e4),
    ),
    "llama3": (
        "Llama",
        dict(vocab_size=47, hidden_size=20, num_hidden_layers=3, num_attention_heads=5,
             num_key_value_heads=1, head_dim=6, intermediate_size=36, attention_bias=True,
             pad_token_id=3,  # the embedding row of the pad token gets no gradient from its use
             rms_norm_eps=1e-5, max_position_embeddings=128,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16}),
    ),
    "llama-linear": (
        "Llama",
        dict(vocab_size=29, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, intermediate_size=16,
             rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=100.0),
    ),
}  # fmt: skip


def hf_model(name: str, seed: int = 0, *, tied: bool = False, qk_noise: float = 1.0):
    prefix, kw = FAMILIES[name]
    conf = getattr(transformers, f"{prefix}Config")(tie_word_embeddings=tied, **kw)
    torch.manual_seed(seed)
    ref = getattr(transformers, f"{prefix}ForCausalLM")(conf).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb so they matter
        for n, p in ref.named_parameters():  # large q/k: sharp, position-sensitive attention
            p.add_(torch.randn_like(p) * (qk_noise if "q_proj" in n or "k_proj" in n else 0.25))
    return ref
