"""``odcfn export`` of a LoRA run: its checkpoints hold the adapters only (and a reference to the
frozen base), so the export rebuilds the base as the run did (``model.hf_path``, or a fresh model
from ``model.seed``), verifies it is the base the adapters were trained on, and writes either a
merged Hugging Face model (the default: ``W + scale * B A`` folded in, loadable without PEFT) or
a PEFT adapter directory (``--adapter``). Rank, alpha, targets and rsLoRA come from the run's
stored config: the user retypes nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from odcfn.sft.config import SFTConfig, model_config

__all__ = ["lora_params", "write_adapter"]


def lora_params(ck: Path, cfg: SFTConfig) -> tuple[Any, Any, dict[str, Any]]:
    """``(QwenConfig, LoRA model, full params: base + adapters)`` of LoRA checkpoint ``ck``."""
    import odcfn
    from odcfn import lora
    from odcfn.checkpoint.frozen import KEY, trained_model, verify_base
    from odcfn.checkpoint.sharded import read_manifest, read_shards
    from odcfn.models import from_hf, init_params, qwen_model

    c = cfg.lora
    if cfg.model.hf_path:
        qcfg, base = from_hf(cfg.model.hf_path)
    else:
        qcfg = model_config(cfg)
        base = init_params(qcfg, seed=cfg.model.seed)
    model, _ = lora.apply(qwen_model(qcfg), {}, rank=c.rank, alpha=c.alpha, targets=tuple(c.targets),
                          dropout=c.dropout, use_rslora=c.use_rslora, seed=c.seed)
    # the base's files still hash as they did when the adapters were saved
    verify_base(read_manifest(ck).get("extra", {}).get(KEY), model, ck, cfg.model.hf_path)
    trained, mesh = trained_model(model), odcfn.Mesh(1)
    adapters = odcfn.unshard([read_shards(ck, model=trained, mesh=mesh)[0]], trained, mesh)
    return qcfg, model, {**base, **adapters}


def write_adapter(out: str | os.PathLike, model: Any, params: dict[str, Any], cfg: SFTConfig, *,
                  dtype: Any = None) -> Path:
    """The run's adapters as a PEFT directory whose ``base_model_name_or_path`` is the run's base."""
    from odcfn.lora import adapter_units, write_peft

    if not cfg.model.hf_path:
        raise ValueError(
            "odcfn export --adapter: the run's base is a fresh model (no model.hf_path), which no "
            "PEFT loader can find: export the merged model (without --adapter) instead"
        )
    adapters = {k: params[k] for k in adapter_units(model)}
    return write_peft(out, model, adapters, base_model_name_or_path=str(Path(cfg.model.hf_path).resolve()),
                      dtype=dtype)
