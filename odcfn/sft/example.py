"""``odcfn train --init DIR``: a runnable example config and a generated SFT-shaped dataset."""

from __future__ import annotations

import os
from pathlib import Path

from odcfn.sft.reference import config_toml

__all__ = ["EXAMPLE_TOML", "write_example"]

# what the example sets apart from the defaults: a tiny model and a short run that finish in
# seconds on a laptop's CPU; every other key is written with its default
EXAMPLE_VALUES = {
    ("", "out_dir"): "out",
    ("model", "vocab_size"): 128, ("model", "d_model"): 32, ("model", "n_layers"): 2,
    ("model", "n_heads"): 4, ("model", "n_kv_heads"): 2, ("model", "d_ff"): 64,
    ("data", "path"): "train.jsonl",
    ("train", "steps"): 12, ("train", "lr"): 3e-3, ("train", "warmup_steps"): 2,
    ("train", "schedule"): "cosine", ("train", "max_grad_norm"): 1.0, ("train", "balance"): "lb_mini",
    ("train", "max_tokens_per_microbatch"): 256, ("train", "world_size"): 2,
    ("checkpoint", "every"): 4, ("checkpoint", "keep"): 2,
}


EXAMPLE_TOML = config_toml(EXAMPLE_VALUES, header=(
    "# odcfn train --config run.toml   (written by `odcfn train --init`)\n"
    "# every key, with its meaning and default; docs/config.md has the allowed values"
))


def write_example(
    directory: str | os.PathLike, *, num_samples: int = 48, seed: int = 0, force: bool = False
) -> Path:
    """A runnable example: ``run.toml`` and a generated SFT-shaped ``train.jsonl``. Refuses to
    overwrite either file (an edited config, a user's data) unless ``force``."""
    import random

    from odcfn.data.records import synthetic_records, write_jsonl
    from odcfn.sft.occupied import refuse_existing_files

    root = Path(directory)
    refuse_existing_files([root / "run.toml", root / "train.jsonl"], "odcfn train --init", force=force)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lengths = [min(256, int(16 + rng.lognormvariate(3.5, 0.7))) for _ in range(num_samples)]
    write_jsonl(root / "train.jsonl", synthetic_records(lengths, 128, seed=seed))
    (root / "run.toml").write_text(EXAMPLE_TOML)
    return root / "run.toml"
