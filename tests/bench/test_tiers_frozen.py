"""``python -m odcfn.bench.tiers_frozen`` (the frozen-base rows of docs/memory.md): a base held
in int8/fp8 takes the formats' bytes in the state, its publication is the one a kept base's
int8 gathers publish, and the step's loss equals the kept base's."""

from __future__ import annotations

import math

from odcfn.bench.tiers_frozen import measure_frozen, render


def test_held_base_rows_take_the_formats_bytes_and_change_no_loss():
    rows = measure_frozen(d_model=32, n_layers=1, vocab_size=256, rank=2)
    bf16, kept, held_int8, held_fp8 = rows
    sizes = bf16["shard_sizes"]  # rank 0's frozen shards
    assert kept["state_bytes"] == bf16["state_bytes"] == bf16["published_bytes"] == 2 * sum(sizes)
    # per shard: one byte a value padded to 4, one fp32 scale per started block of 128
    want = sum(4 * math.ceil(n / 4) + 4 * math.ceil(n / 128) for n in sizes)
    assert held_int8["state_bytes"] == held_fp8["state_bytes"] == want
    assert abs(held_int8["state_ratio"] - (1 + 4 / 128) / 2) < 0.01  # the part blocks of small shards
    assert held_int8["published_bytes"] == kept["published_bytes"] == held_int8["state_bytes"]
    assert held_int8["loss"] == kept["loss"] != bf16["loss"]
    assert "quantize_frozen" in render(rows)
