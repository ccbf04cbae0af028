"""Peak tensor bytes of one projection's LoRA dropout A path, the whole-mask code odcfn used
before (drawn whole in fp32, the bool mask and the dropped input kept for backward) against the
tiled plan (odcfn/lora/dropout.py): forward, then backward beyond the input's own gradient.

    PYTHONPATH=. python bench/lora_dropout_memory.py 32768 4096 16    # tokens d_in rank
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from odcfn.lora.dropout import dropout_plan
from tests.memtrack import TensorBytes

P = 0.05


def main(T: int, d: int, r: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(T, d, requires_grad=True)
    a = torch.randn(r, d, requires_grad=True)

    def before(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        m = torch.rand(T, d) < P
        return F.linear(x.masked_fill(m, 0) * (1 / (1 - P)), a)

    plan = dropout_plan(P, seed=0, step=1, unit="layers.0", path="self_attn.q_proj",
                        samples=(0,), lengths=(T,))
    for name, fn in (("whole mask (before)", before), ("tiles (now)", plan)):
        x.grad = a.grad = None
        t0 = time.perf_counter()
        with TensorBytes() as f:
            y = fn(x, a)
        kept = f.current - y.numel() * y.element_size()
        with TensorBytes() as b:
            y.backward(torch.ones_like(y))
        print(f"{name}: T={T} d_in={d} r={r}: forward peak {f.peak / 2**20:.1f} MiB, kept for backward "
              f"{kept / 2**20:.1f} MiB, backward peak beyond dx {(b.peak - x.numel() * 4) / 2**20:.1f} MiB, "
              f"{time.perf_counter() - t0:.2f}s")


if __name__ == "__main__":
    main(*(int(v) for v in sys.argv[1:4]))
