"""End-to-end check of the long-context head: ``log_probs`` of one rollout and one ``train_step``
of one sample at a real vocabulary, on one rank, every block rematerialised, in a fresh process
per point; prints the process's peak RSS and its RSS before the pass.

    python bench/long_context_e2e.py --tokens 1024 --vocab 151936 --what train --head fused

``--head unfused`` runs the full-logits reference head (O(T×V)) for comparison; ``--what
logprobs`` the forward-only pass (with entropies). Model: a Qwen-shaped decoder, D=256, 2 layers.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

import odcfn
from odcfn.models import QwenConfig, init_params, qwen_model


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--what", choices=("train", "logprobs"), default="train")
    ap.add_argument("--head", choices=("fused", "unfused"), default="fused")
    ap.add_argument("--loss", choices=("ce", "grpo"), default="ce")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = QwenConfig(vocab_size=a.vocab, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=768)
    model = qwen_model(cfg)
    T = a.tokens
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, a.vocab, (T,), generator=g)
    extras = None
    if a.loss == "grpo":
        old = lambda: -torch.rand(T, generator=g) * 4 - 8  # ~ log(1/V)
        extras = {"advantages": torch.randn(T, generator=g), "old_logprobs": old(), "ref_logprobs": old()}
        loss = odcfn.losses.policy_gradient(kl_loss_coef=0.001, entropy_coeff=0.001, head=a.head)
    else:
        loss = odcfn.losses.cross_entropy(head=a.head)
    batch = odcfn.Batch((odcfn.Sample(tokens, extras=extras),))
    options = odcfn.ScheduleOptions(remat=frozenset(u for u in model.unit_names if u.startswith("layers.")))
    config = odcfn.StepConfig(comm="odc", balance="lb_mini", options=options, loss=loss)

    def worker(rank, transport):
        state = odcfn.TrainState.create(params=init_params(cfg), model=model, optimizer=odcfn.sgd(0.0),
                                        transport=transport, config=config)
        before = _rss_mib()
        t0 = time.perf_counter()
        if a.what == "train":
            _, m = odcfn.train_step(state, batch)
            out = {"loss": m.loss}
        else:
            lp, ent = odcfn.log_probs(state, batch, entropy=True, head=a.head)
            out = {"mean_logp": float(lp[0][1:].mean()), "mean_entropy": float(ent[0][1:].mean())}
        return before, time.perf_counter() - t0, out

    before, seconds, out = odcfn.run_local(worker, 1)[0]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens": T, "vocab": a.vocab, "what": a.what, "head": a.head, "loss": a.loss,
                      "rss_before_mib": round(before), "peak_rss_mib": round(peak),
                      "pass_mib": round(peak - before), "seconds": round(seconds, 1), **out}))


if __name__ == "__main__":
    main()
