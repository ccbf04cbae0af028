"""A trained model as a Hugging Face model directory that transformers and inference engines
load as they are: weights (safetensors), a complete ``config.json``, ``generation_config.json``
and the tokenizer's files.

What goes into ``config.json`` beyond the computation (``odcfn.models.hf_config.config_to_hf``):
a run that started from a Hugging Face checkpoint keeps every field of that checkpoint's
config (special token ids, maximum positions, ...) and its generation config; a fresh model
takes the tokenizer's special token ids, and the generation config beside the tokenizer's files
when there is one. ``odcfn export`` writes the same from a checkpoint
directory (``export_checkpoint``), so a run under torchrun exports from its last checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from odcfn.sft.config import SFTConfig, config_from_stored, model_config

__all__ = ["add_arguments", "export_checkpoint", "export_params", "find_checkpoint", "main"]


def _tokenizer_dir(cfg: SFTConfig) -> Path | None:
    """The run's tokenizer: ``data.tokenizer``, else the source checkpoint's own tokenizer."""
    from odcfn.data.chat import TOKENIZER_FILES

    for d in (cfg.data.tokenizer, cfg.model.hf_path):
        if d and any((Path(d) / name).is_file() for name in TOKENIZER_FILES):
            return Path(d)
    return None


def _special_ids(tok_dir: Path) -> dict[str, Any]:
    """bos/eos ids from the tokenizer's files (no pad: a pad id would change the model's embedding
    gradient, and the model trained without one)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    return {k: getattr(tok, k) for k in ("bos_token_id", "eos_token_id") if getattr(tok, k, None) is not None}


def export_params(out: str | os.PathLike, params: dict, qcfg: Any, cfg: SFTConfig, *, dtype=None) -> Path:
    """Write the unsharded ``params`` of the run ``cfg`` as a Hugging Face model directory."""
    from odcfn.data.chat import TOKENIZER_FILES
    from odcfn.models.hf import to_hf

    root = to_hf(out, params, qcfg, dtype=dtype)
    ours = json.loads((root / "config.json").read_text())
    tok_dir = _tokenizer_dir(cfg)
    gen: dict[str, Any] | None = None
    if cfg.model.hf_path:
        # every field of the source's config as it was written (its special token ids, maximum
        # positions, ...: the computation is the same, config_from_hf read it); the dtype is
        # that of the files written here
        src = Path(cfg.model.hf_path)
        doc = {**ours, **json.loads((src / "config.json").read_text())}
        for key in ("torch_dtype", "dtype"):
            if key in doc or key == "torch_dtype":
                doc[key] = ours["torch_dtype"]
        if (src / "generation_config.json").is_file():
            gen = json.loads((src / "generation_config.json").read_text())
    else:
        doc = {**ours, **(_special_ids(tok_dir) if tok_dir else {})}
    if gen is None and tok_dir is not None and (tok_dir / "generation_config.json").is_file():
        # a tokenizer taken from a model's directory brings that model's generation settings
        gen = json.loads((tok_dir / "generation_config.json").read_text())
    if gen is None:
        gen = {k: doc[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if doc.get(k) is not None}
    (root / "config.json").write_text(json.dumps(doc, indent=2))
    (root / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tok_dir is not None:
        for name in TOKENIZER_FILES:  # copyfile: the new files get ordinary permissions
            if (tok_dir / name).is_file():
                shutil.copyfile(tok_dir / name, root / name)
    return root


def find_checkpoint(path: str | os.PathLike) -> Path:
    """A committed checkpoint: ``path`` itself, or the newest one under ``path`` or under
    ``path/checkpoints`` (a run's out_dir)."""
    from odcfn.checkpoint.sharded import MANIFEST, latest

    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    for root in (p, p / "checkpoints"):
        ck = latest(root)
        if ck is not None:
            return ck
    raise FileNotFoundError(
        f"{p}: no committed odcfn checkpoint here (give a run's out_dir, its checkpoints/ directory "
        "or one step-XXXXXXXX checkpoint)"
    )


def export_checkpoint(
    path: str | os.PathLike, out: str | os.PathLike, *, tokenizer: str | None = None, dtype=None,
    adapter: bool = False,
) -> Path:
    """Export checkpoint ``path`` (see ``find_checkpoint``) of an ``odcfn train`` run to ``out``;
    ``tokenizer`` overrides the run's tokenizer directory. A LoRA run exports merged weights, or
    with ``adapter`` a PEFT adapter directory (``odcfn.sft.lora_export``)."""
    from dataclasses import replace

    import odcfn
    from odcfn.checkpoint.sharded import read_manifest, read_shards
    from odcfn.models import qwen_model

    ck = find_checkpoint(path)
    stored = read_manifest(ck).get("extra", {}).get("config")
    if not isinstance(stored, dict):
        raise ValueError(f"{ck}: the checkpoint has no odcfn train config (was it written by odcfn train?)")
    cfg = config_from_stored(stored)
    if tokenizer is not None:
        cfg = replace(cfg, data=replace(cfg.data, tokenizer=str(tokenizer)))
    if cfg.lora.rank:
        from odcfn import lora
        from odcfn.sft.lora_export import lora_params, write_adapter

        qcfg, lmodel, full = lora_params(ck, cfg)
        if adapter:
            return write_adapter(out, lmodel, full, cfg, dtype=dtype)
        return export_params(out, lora.merge(lmodel, full), qcfg, cfg, dtype=dtype)
    if adapter:
        raise ValueError(f"odcfn export --adapter: {ck} is not of a LoRA run (its config has no lora.rank)")
    qcfg = model_config(cfg)
    model = qwen_model(qcfg)
    mesh = odcfn.Mesh(1)  # resharded onto one rank: the full parameters
    params = odcfn.unshard([read_shards(ck, model=model, mesh=mesh)[0]], model, mesh)
    return export_params(out, params, qcfg, cfg, dtype=dtype)


# --- command line ------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a run's out_dir, its checkpoints/ directory, or one checkpoint")
    p.add_argument("out", help="the Hugging Face model directory to write")
    p.add_argument("--tokenizer", help="tokenizer directory to include (default: the run's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype of the written weights (default float32, as trained)")
    p.add_argument("--adapter", action="store_true",
                   help="LoRA runs: write a PEFT adapter directory (default: the merged model)")
    p.add_argument("--force", action="store_true", help="write into OUT even if it is not empty")


def main(args: argparse.Namespace) -> int:
    import torch

    from odcfn.sft.occupied import refuse_nonempty_dir

    dtype = getattr(torch, args.dtype)
    ck = find_checkpoint(args.checkpoint)
    refuse_nonempty_dir(args.out, "odcfn export", force=args.force)  # before any weight is read
    out = export_checkpoint(ck, args.out, tokenizer=args.tokenizer, dtype=dtype,
                            adapter=getattr(args, "adapter", False))
    print(f"odcfn export: wrote {out} from {ck}")
    return 0
