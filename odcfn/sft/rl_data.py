"""``odcfn train``'s prompts (``train.task = "rl"``): TRL's prompt-only rows through the local
tokenizer (``odcfn.data.prompts``), read and checked once before any rank starts like the SFT
data (``odcfn.sft.prepare``), and the prompts of every iteration: ``data.batch_size`` of them,
a pure function of the iteration (the per-epoch order of ``odcfn.data.records.epoch_order``),
so a resumed run draws the prompts the interrupted one would have."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from odcfn.data.prompt import Prompt
from odcfn.data.prompts import PromptDataset

__all__ = ["PreparedPrompts", "prepare_prompts", "rl_lines"]

_SHOW = 5


@dataclass(frozen=True)
class PreparedPrompts:
    """The prompts an RL run trains on (``PreparedData``'s counterpart: the loop, the opening
    lines and the summary read the same attributes)."""

    data: PromptDataset
    per_epoch: int  # iterations per pass over the prompts
    dropped: tuple[str, ...] = ()  # file:line of each prompt left out for its length
    truncated: tuple[str, ...] = ()  # never: a cut prompt is refused by the config
    skip_steps: frozenset[int] = field(default_factory=frozenset)  # never

    @property
    def dataset(self) -> PromptDataset:
        return self.data

    def indices(self, it: int, d: Any) -> list[int]:
        """The prompt indices of iteration ``it`` (0-based; ``d``: the ``[data]`` section)."""
        from odcfn.data.records import epoch_order

        epoch, i = divmod(it, self.per_epoch)
        return epoch_order(len(self.data), epoch, d.seed, d.shuffle)[i * d.batch_size:(i + 1) * d.batch_size]

    def batch(self, it: int, d: Any) -> list[Prompt]:
        """Iteration ``it``'s prompts: the same on every rank, a pure function of ``it``."""
        return [self.data.prompts[k] for k in self.indices(it, d)]

    def report(self) -> dict[str, Any]:
        return {"samples": len(self.data), "prompts": len(self.data), "truncated": [],
                "dropped": list(self.dropped), "skipped_steps": []}


def _too_long(cfg: Any, n: int) -> str | None:
    """Why a prompt of ``n`` tokens cannot be trained on, or None: the engine must have room for
    one new token, ``data.max_length`` bounds the prompt (verl's max_prompt_length), and its
    longest sample (prompt + response) must fit one microbatch."""
    ro, cap = cfg.rollout, cfg.train.max_tokens_per_microbatch
    if n >= ro.max_model_len:
        return (f"'prompt' has {n} tokens; the engine's maximum length rollout.max_model_len = "
                f"{ro.max_model_len} leaves no room for an answer")
    if cfg.data.max_length is not None and n > cfg.data.max_length:
        return f"'prompt' has {n} tokens, more than data.max_length = {cfg.data.max_length}"
    longest = min(n + ro.max_tokens, ro.max_model_len)
    if cap is not None and longest > cap:
        return (f"'prompt' has {n} tokens: with rollout.max_tokens = {ro.max_tokens} a sample may reach "
                f"{longest}, more than train.max_tokens_per_microbatch = {cap}")
    return None


def _names(where: list[str]) -> str:
    more = f" and {len(where) - _SHOW} more" if len(where) > _SHOW else ""
    return ", ".join(where[:_SHOW]) + more


def prepare_prompts(cfg: Any, vocab_size: int) -> PreparedPrompts:
    """Read and check every prompt of ``data.path`` (``file:line`` and key named for each
    problem), after checking that the reward resolves (its fields are checked on every row)."""
    from odcfn.data.chat import load_tokenizer
    from odcfn.data.prompts import read_prompts
    from odcfn.sft.config_rl import check_rl_inputs, reward_fields

    d = cfg.data
    reward = check_rl_inputs(cfg)
    data = read_prompts(d.path, load_tokenizer(d.tokenizer), vocab_size=vocab_size,
                        required_fields=reward_fields(cfg, reward),
                        reward_name=f"rl.reward = {cfg.rl.reward!r}")
    long = [(w, why) for p, w in zip(data.prompts, data.where) if (why := _too_long(cfg, len(p)))]
    if long and d.long_samples == "error":
        raise ValueError(f"{long[0][0]}: {long[0][1]} ({len(long)} such prompt(s): "
                         f"{_names([w for w, _ in long])}); raise the limit, or set "
                         "data.long_samples = \"drop\"")
    if long:
        out = set(w for w, _ in long)
        keep = [k for k, w in enumerate(data.where) if w not in out]
        if not keep:
            raise ValueError(f"{d.path}: every prompt is too long: nothing to train on ({long[0][1]})")
        data = PromptDataset(tuple(data.prompts[k] for k in keep), data.source,
                             tuple(data.where[k] for k in keep))
    per_epoch = len(data) // d.batch_size
    if per_epoch == 0:
        raise ValueError(f"{d.path}: {len(data)} prompt(s), fewer than data.batch_size = {d.batch_size} "
                         "(prompts per iteration with train.task = \"rl\")")
    return PreparedPrompts(data, per_epoch, tuple(w for w, _ in long))


def rl_lines(cfg: Any, data: PreparedPrompts) -> list[str]:
    """The opening lines of an RL run: what each iteration does, and its prompts."""
    r, ro, d = cfg.rl, cfg.rollout, cfg.data
    kl = f"kl {r.kl_loss_type} x {r.kl_loss_coef:g} to " + ("the base (adapters off)" if cfg.lora.rank else
                                                          "the initial model") if r.kl_loss_coef else "no kl"
    mode = "async (one step ahead, decoupled)" if r.async_rollouts else "sync"
    return [
        f"task: rl, reward {r.reward}, {r.estimator} over groups of {r.group_size}, {kl}, {r.ppo_epochs} "
        f"epoch(s) x {r.ppo_mini_batches} minibatch(es) per iteration, {mode}",
        f"rollout: {ro.engine} engine, max_tokens {ro.max_tokens}, temperature {ro.temperature:g}, "
        f"top_p {ro.top_p:g}, top_k {ro.top_k}, max_model_len {ro.max_model_len}",
        f"data: {d.path} (prompts, tokenizer {d.tokenizer}): {len(data.data)} prompts, "
        f"{data.data.num_tokens} tokens; {d.batch_size} prompts x {r.group_size} completions per iteration, "
        f"{data.per_epoch} iterations per epoch{', shuffled' if d.shuffle else ''}",
    ]
