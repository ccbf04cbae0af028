"""``odcfn train --init DIR``: a runnable example config and a generated SFT-shaped dataset."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["EXAMPLE_TOML", "write_example"]

EXAMPLE_TOML = """\
# odcfn train --config run.toml   (written by `odcfn train --init`)
out_dir = "out"

[model]
vocab_size = 128
d_model = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
d_ff = 64
seed = 0

[data]
path = "train.jsonl"
batch_size = 8
seed = 0

[train]
steps = 12
lr = 3e-3
warmup_steps = 2
schedule = "cosine"
max_grad_norm = 1.0
comm = "odc"
balance = "lb_mini"
max_tokens_per_microbatch = 256
world_size = 2
backend = "threads"

[checkpoint]
every = 4
keep = 2

[log]
every = 1
"""


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
