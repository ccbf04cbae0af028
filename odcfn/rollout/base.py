"""The rollout engine's interface: what an RL loop asks of whatever generates its samples.

An engine is rank-local: each rank holds one and calls ``generate`` on its share of the prompts
(the RL loop then shares the completions, so every rank holds the same minibatch).
``update_weights(state)`` is collective like ``odcfn.gather_params``: every rank of the trainer
calls it with its state, and the engine's ``version`` then names the trainer step its weights
came from.

``SamplingParams`` keeps vLLM's names and meanings (temperature 0 is greedy, ``top_k=0`` is no
top-k), and a ``Completion``'s ``logprobs`` are the behaviour policy's: each generated token's
fp32 log-prob after temperature and before top-k / top-p, the value
``odcfn.log_probs(..., temperature=T)`` computes for the same sequence.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from odcfn._check import ArgTypeError, check_int, check_number, is_int

__all__ = ["FINISH_REASONS", "Completion", "Engine", "SamplingParams", "check_prompts"]

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: vLLM's names and semantics.

    ``max_tokens``: new tokens per completion at most. ``temperature``: 0 is greedy (then
    ``top_p``/``top_k`` do not matter). ``top_p`` in (0, 1]; ``top_k`` 0 (or -1, vLLM's spelling)
    means no top-k. ``stop_token_ids``: generation stops after emitting one of these (it is kept
    as the completion's last token, ``finish_reason="stop"``). ``n``: completions per prompt,
    grouped in prompt order. ``seed``: None draws from fresh entropy; an int makes every
    completion a function of (seed, its prompt's position in the call, its index in the group).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        check_int(self.max_tokens, "SamplingParams.max_tokens", at_least=1)
        check_number(self.temperature, "SamplingParams.temperature", at_least=0.0)
        p = check_number(self.top_p, "SamplingParams.top_p", positive=True)
        if p > 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        check_int(self.top_k, "SamplingParams.top_k", at_least=-1, want="an int >= 0 (0 or -1: no top-k)")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Sequence):
            raise ArgTypeError(
                f"SamplingParams.stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}"
            )
        for t in self.stop_token_ids:
            check_int(t, "SamplingParams.stop_token_ids[*]", at_least=0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "top_k", 0 if self.top_k == -1 else int(self.top_k))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        check_int(self.n, "SamplingParams.n", at_least=1)
        check_int(self.seed, "SamplingParams.seed", none_ok=True)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Completion:
    """One generated continuation of one prompt.

    ``prompt_index``: its prompt's position in the ``generate`` call. ``tokens``: the generated
    ids (LongTensor, the stop token included when it ended on one). ``logprobs``: fp32, one per
    generated token: the behaviour policy's log-prob after temperature, before top-k / top-p.
    ``finish_reason``: ``"stop"`` (a stop token) or ``"length"`` (``max_tokens`` or the
    engine's maximum length). ``text``: the decoded tokens when the engine knows a tokenizer.
    ``routed_experts``: for a mixture of experts, the experts each input position of
    ``prompt + tokens`` was routed to, ``(P + R, MoE layers, top-k)`` int (routing replay; the
    last row, a position whose output predicts nothing, repeats its neighbour). ``version``: the
    engine's weight version that generated it.
    """

    prompt_index: int
    tokens: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: str
    text: str | None = None
    routed_experts: torch.Tensor | None = None
    version: int = 0

    def __post_init__(self) -> None:
        check_int(self.prompt_index, "Completion.prompt_index", at_least=0)
        if not isinstance(self.tokens, torch.Tensor) or self.tokens.dim() != 1:
            raise TypeError(f"Completion.tokens must be a 1-D LongTensor, got {self.tokens!r}")
        if not isinstance(self.logprobs, torch.Tensor) or self.logprobs.shape != self.tokens.shape:
            raise ValueError(
                f"Completion.logprobs must be a tensor of the tokens' shape {tuple(self.tokens.shape)}"
            )
        object.__setattr__(self, "tokens", self.tokens.long())
        object.__setattr__(self, "logprobs", self.logprobs.float())
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Completion.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


class Engine(abc.ABC):
    """A rollout engine (``LocalEngine``, ``VLLMEngine``). Use it as a context manager or call
    ``close()``. ``max_model_len``: prompt plus completion tokens at most."""

    max_model_len: int

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The trainer step (``TrainState.step``) of the weights the engine samples with; 0 for
        the weights it was built with until the first ``update_weights``."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                 first_index: int = 0) -> list[Completion]:
        """``sampling.n`` completions per prompt, grouped in prompt order
        (``len(prompts) * n`` in all). ``first_index``: the position of ``prompts[0]`` for
        seeding only (prompt i draws as position ``first_index + i``): an RL loop that shares a
        prompt list among ranks passes each share's offset, so a seeded run draws the same
        samples whatever the number of ranks. ``Completion.prompt_index`` stays i."""

    @abc.abstractmethod
    def update_weights(self, state: Any) -> None:
        """Load the trainer's current weights (every rank calls it, as with ``gather_params``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the engine's resources; idempotent. Subclasses call ``self.shutdown_background()``."""

    # --- one generation in the background (asynchronous RL) ----------------------------------
    # The engine owns the generation it is running, so the loop that started it can collect it
    # an iteration later without keeping a handle of its own: one request at a time, named by a
    # key so a collector asking for other prompts gets an error, never someone else's rollouts.

    def submit(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, key: Hashable = None,
               first_index: int = 0) -> None:
        """Start ``generate(prompts, sampling, first_index=...)`` on a background thread;
        ``collect(key)`` returns it."""
        if getattr(self, "_inflight", None) is not None:
            what = f"{self._inflight[0]!r:.60}"
            raise RuntimeError(f"{type(self).__name__}.submit: a generation ({what}) is in flight; "
                               "collect it first")
        if getattr(self, "_pool", None) is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="odcfn-rollout")
        self._inflight: tuple[Hashable, Future] | None = (key, self._pool.submit(
            self.generate, prompts, sampling, first_index=first_index))

    @property
    def in_flight(self) -> Hashable | None:
        """The key of the background generation not yet collected, or None."""
        got = getattr(self, "_inflight", None)
        return None if got is None else got[0]

    def wait(self) -> None:
        """Block until the background generation (if any) has finished; its result stays to collect.
        Call it before ``update_weights``: weights must not change under a running generation."""
        got = getattr(self, "_inflight", None)
        if got is not None:
            got[1].exception()  # waits; a failure is raised by collect

    def collect(self, key: Hashable = None) -> list[Completion]:
        """The background generation's completions (waits for it); ``key`` must match submit's."""
        got = getattr(self, "_inflight", None)
        if got is None:
            raise RuntimeError(f"{type(self).__name__}.collect: no generation in flight")
        if got[0] != key:
            raise ValueError(f"{type(self).__name__}.collect: the generation in flight is for {got[0]!r}, "
                             f"not {key!r}")
        self._inflight = None
        return got[1].result()

    def shutdown_background(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._inflight = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_prompts(
    prompts: Any, vocab_size: int, max_model_len: int, sampling: SamplingParams
) -> list[list[int]]:
    """The prompts as lists of ints, or a ``ValueError``/``TypeError`` naming the first bad one:
    not a sequence of ints, empty, a token outside the vocabulary, or too long to leave room for
    one new token within ``max_model_len``."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be an odcfn.rollout.SamplingParams, got {type(sampling).__name__}")
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            if p.dim() != 1 or p.dtype.is_floating_point or p.dtype == torch.bool:
                raise TypeError(f"prompt {i} must be a 1-D integer tensor or a list of ints, got {p!r}")
            ids = [int(t) for t in p.tolist()]
        elif isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or not all(is_int(t) for t in p):
            raise TypeError(f"prompt {i} must be a list of token ids (ints), got {p!r:.80}")
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if len(ids) >= max_model_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens: the engine's maximum length is {max_model_len} "
                "(prompt + at least one new token)"
            )
        out.append(ids)
    return out
