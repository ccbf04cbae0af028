"""The workload shared by ``odcfn demo`` and ``odcfn bench``: a small Qwen-style model, synthetic
long-tail SFT minibatches scaled down to run in seconds per step on a CPU, and the policies
(communication mode x balancer) compared on them.

Every rank builds the same minibatches from (seed, step) alone, so no data moves between ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from odcfn.batch import Batch, random_batch
from odcfn.models import QwenConfig
from odcfn.schedule.lengths import LONGALIGN_MAX, longalign

__all__ = [
    "SAME_WIRE",
    "Workload",
    "collectives_of",
    "make_batch",
    "make_lengths",
    "model_config",
    "sample_longalign_like",
]

# LongAlign's SFT lengths span 8K-64K tokens with a mean of ~16.5K (the ODC paper's Table/Fig.);
# divided by ``Workload.length_scale`` so a sample costs ~0.1-3 s of CPU per step.
LONGALIGN_MEAN = 16500


# The collective baseline run over the same shared memory as ODC (``ShmTransport(collectives=
# "shm")``), so that ODC against it differs in synchronisation only, not in the wire (its
# (comm, balance) entry is in ``odcfn.schedule.policy.SCHEDULES``, as every schedule's).
SAME_WIRE = "collective-shm+lb-micro"


def collectives_of(policy: str) -> str:
    """The ``ShmTransport(collectives=...)`` a policy runs on: ``"shm"`` for the same-wire
    baseline, ``"gloo"`` (what users run by default) for every other."""
    return "shm" if policy == SAME_WIRE else "gloo"


def model_config(d_model: int = 128, n_layers: int = 4, vocab_size: int = 512) -> QwenConfig:
    """The benchmark model family: 4 query heads, 2 KV heads (GQA), SwiGLU width 3 x d_model."""
    return QwenConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=4,
                      n_kv_heads=2, d_ff=3 * d_model)


@dataclass(frozen=True)
class Workload:
    """Everything that defines the data and the model of a run (picklable, hashable)."""

    model: QwenConfig = field(default_factory=model_config)
    world_size: int = 2
    samples_per_rank: int = 4
    length_scale: int = 32  # LongAlign lengths / 32: 256-2048 tokens, mean ~515
    balanced: bool = False  # all samples of equal (mean) length: no imbalance to remove
    seed: int = 0
    lr: float = 1e-3
    # or "aime-rl": GRPO groups under policy_gradient (bench/rl.py); or "preference": DPO pairs
    # (bench/preference.py), samples_per_rank then counting pairs
    dataset: str = "longalign"
    group_size: int = 4  # aime-rl: responses per prompt

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"Workload.world_size must be a positive int, got {self.world_size!r}")
        if not isinstance(self.samples_per_rank, int) or self.samples_per_rank < 1:
            raise ValueError(
                f"Workload.samples_per_rank must be a positive int, got {self.samples_per_rank!r}"
            )
        if not isinstance(self.length_scale, int) or self.length_scale < 1:
            raise ValueError(
                f"Workload.length_scale must be a positive int, got {self.length_scale!r}"
            )
        if self.dataset not in ("longalign", "aime-rl", "preference"):
            raise ValueError(
                f"Workload.dataset must be 'longalign', 'aime-rl' or 'preference', got {self.dataset!r}"
            )

    @property
    def samples_per_step(self) -> int:
        return self.world_size * self.samples_per_rank

    @property
    def max_tokens_per_microbatch(self) -> int:
        """The cap: the longest possible sample (LongAlign's 64K, or AIME's cap, scaled)."""
        if self.dataset == "aime-rl":
            from odcfn.bench.rl import rl_max_tokens

            return rl_max_tokens(self.length_scale)
        if self.dataset == "preference":
            from odcfn.bench.preference import preference_max_tokens

            return preference_max_tokens(self.length_scale)
        return LONGALIGN_MAX // self.length_scale

    @property
    def loss(self):
        """The StepConfig.loss of the workload (None: token cross-entropy)."""
        if self.dataset == "aime-rl":
            from odcfn.bench.rl import rl_loss

            return rl_loss()
        if self.dataset == "preference":
            from odcfn.bench.preference import preference_loss

            return preference_loss()
        return None

    def with_(self, **kw) -> Workload:
        return replace(self, **kw)


def sample_longalign_like(n: int, *, seed: int) -> list[int]:
    """``n`` LongAlign-like lengths (unscaled): ``odcfn.schedule.lengths.longalign``."""
    return list(longalign(n, seed=seed))


def make_lengths(w: Workload, step: int) -> tuple[int, ...]:
    """Sample lengths of minibatch ``step`` (deterministic in (seed, step))."""
    n = w.samples_per_step
    if w.dataset == "aime-rl":
        from odcfn.bench.rl import rl_lengths

        return tuple(t for _, t in rl_lengths(n, w.group_size, w.length_scale, w.seed * 100_003 + step))
    if w.dataset == "preference":
        from odcfn.bench.preference import member_lengths

        return member_lengths(n, w.length_scale, w.seed * 100_003 + step)
    if w.balanced:
        return (LONGALIGN_MEAN // w.length_scale,) * n
    raw = sample_longalign_like(n, seed=w.seed * 100_003 + step)
    cap = w.max_tokens_per_microbatch
    return tuple(max(2, min(cap, x // w.length_scale)) for x in raw)


def make_batch(w: Workload, step: int) -> Batch:
    if w.dataset == "aime-rl":
        from odcfn.bench.rl import rl_batch

        return rl_batch(w.samples_per_step, w.group_size, w.length_scale, w.model.vocab_size,
                        w.seed * 100_003 + step)
    if w.dataset == "preference":
        from odcfn.bench.preference import preference_batch_of

        return preference_batch_of(w.samples_per_step, w.length_scale, w.model.vocab_size,
                                   w.seed * 100_003 + step)
    return random_batch(make_lengths(w, step), w.model.vocab_size, seed=w.seed * 100_003 + step)
