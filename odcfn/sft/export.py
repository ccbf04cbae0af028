"""A trained model as a Hugging Face model directory that transformers and inference engines
load as they are: weights (safetensors), a complete ``config.json``, ``generation_config.json``
and the tokenizer's files.

What goes into ``config.json`` beyond the computation (``odcfn.models.hf_config.config_to_hf``):
a run that started from a Hugging Face checkpoint keeps every field of that checkpoint's
config (special token ids, maximum positions, ...) and its generation config; a fresh model
takes the tokenizer's special token ids, and the generation config beside the tokenizer's files
when there is one. ``odcfn export`` writes the same from a checkpoint
directory (``export_checkpoint``), so a run under torchrun exports from its last checkpoint.

A mixture trained with ``train.expert_bias_rate`` has a learned router bias that a Hugging Face
Qwen-MoE router cannot hold: the export routes by the router weights alone, unlike the trained
model. It is said loudly (a warning on stderr naming the layers and the bias's size and range)
and written down in the export's ``README.md``, with the values, for whoever serves the model."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from odcfn.sft.config import SFTConfig, config_from_stored, model_config

__all__ = ["add_arguments", "export_checkpoint", "export_params", "find_checkpoint", "main",
           "note_router_bias"]


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


def note_router_bias(root: Path, bias: Any, qcfg: Any) -> None:
    """Say that ``bias`` (sparse layers x E, the state's ``router_bias``) is not in the export at
    ``root``: a warning on stderr and a section of ``root/README.md``. Nothing for no bias or an
    all-zero one (it changes no choice)."""
    import torch

    from odcfn.models.moe import sparse_layers

    if bias is None:
        return
    b = torch.as_tensor(bias, dtype=torch.float64)
    if not bool(b.abs().max() > 0):
        return
    units = [f"layers.{i}" for i in sparse_layers(qcfg)]
    gates = ", ".join(f"model.{u}.mlp.gate" for u in units)
    size = f"{b.shape[0]} x {b.shape[1]} (sparse layers x experts)"
    span = f"values in [{float(b.min()):.4g}, {float(b.max()):.4g}]"
    print(f"odcfn export: WARNING: the trained router bias is not exported: {gates} were trained with a "
          f"per-expert bias of {size}, {span} (train.expert_bias_rate), which a Hugging Face Qwen-MoE "
          f"router cannot hold, so {root} routes tokens by the router weights alone, unlike the trained "
          "model; its README.md records the values", file=sys.stderr, flush=True)
    rows = "\n".join(f"{u}: {json.dumps([round(float(x), 8) for x in row])}" for u, row in zip(units, b))
    text = (f"## Router bias not exported\n\nThe trained model's routers ({', '.join(units)}) add a learned "
            f"per-expert bias ({size}, {span}; odcfn's aux-loss-free balancing, train.expert_bias_rate) to "
            "their scores when choosing the top-k experts. A Hugging Face Qwen-MoE router has no such bias, "
            "so this model routes by the router weights alone and can choose other experts than the "
            "trained one. The bias, per sparse layer:\n\n```\n" + rows + "\n```\n")
    readme = root / "README.md"
    before = readme.read_text() + "\n" if readme.is_file() else ""
    readme.write_text(before + text)


def export_params(out: str | os.PathLike, params: dict, qcfg: Any, cfg: SFTConfig, *, dtype=None,
                  router_bias: Any = None) -> Path:
    """Write the unsharded ``params`` of the run ``cfg`` as a Hugging Face model directory
    (``router_bias``: the trained state's, named as not exported: ``note_router_bias``)."""
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
    note_router_bias(root, router_bias, qcfg)
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
    from odcfn.checkpoint.state_io import ROUTER_BIAS
    from odcfn.models import qwen_model

    ck = find_checkpoint(path)
    extra = read_manifest(ck).get("extra", {})
    stored, bias = extra.get("config"), extra.get(ROUTER_BIAS)
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
            root = write_adapter(out, lmodel, full, cfg, dtype=dtype)
            note_router_bias(root, bias, qcfg)
            return root
        return export_params(out, lora.merge(lmodel, full), qcfg, cfg, dtype=dtype, router_bias=bias)
    if adapter:
        raise ValueError(f"odcfn export --adapter: {ck} is not of a LoRA run (its config has no lora.rank)")
    qcfg = model_config(cfg)
    model = qwen_model(qcfg)
    mesh = odcfn.Mesh(1)  # resharded onto one rank: the full parameters
    params = odcfn.unshard([read_shards(ck, model=model, mesh=mesh)[0]], model, mesh)
    return export_params(out, params, qcfg, cfg, dtype=dtype, router_bias=bias)


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
