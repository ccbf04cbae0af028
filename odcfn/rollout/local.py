"""``LocalEngine``: the embedded rollout engine, batched sampling on odcfn's own model.

Sequences run in batches under a token budget: a sequence reserves its prompt plus its new
tokens (``min(max_tokens, max_model_len - prompt)``), joins the batch while the live
reservations fit ``max_batch_tokens`` (one sequence always fits), is prefilled with the others
that join with it, then decodes one token per step against the key/value cache
(``odcfn.rollout.decode``); a finished sequence leaves at once and frees its reservation for the
next waiting one. Sampling follows vLLM (``odcfn.rollout.sample``), each completion on its own
random stream, so with a seed the results do not depend on the budget.

Weights come from the trainer's state (``update_weights``: ``odcfn.gather_params``, or the
merged weights ``odcfn.lora.gather_merged`` for a LoRA state; every rank calls it) or from full
params given to the constructor; no file in between.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import odcfn
from odcfn._check import check_int
from odcfn.models.qwen import QwenConfig, QwenMoeConfig
from odcfn.rollout import decode as dec
from odcfn.rollout.base import Completion, Engine, SamplingParams, check_prompts
from odcfn.rollout.sample import Uniforms, fresh_seed, sample_logprobs, sequence_generator, token_logprobs

__all__ = ["LocalEngine"]


@dataclass
class _Seq:
    """One completion being generated."""

    out: int  # its position in generate's result
    prompt_index: int
    prompt: list[int]
    budget: int  # new tokens at most
    uniforms: Uniforms | None  # None: greedy
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routed: list[torch.Tensor] = field(default_factory=list)  # per fed position: (L, k)
    finish: str | None = None

    @property
    def reserve(self) -> int:
        return len(self.prompt) + self.budget

    @property
    def cached(self) -> int:
        """Positions in the cache: the prompt and every token but the last (not yet fed)."""
        return len(self.prompt) + len(self.tokens) - 1


class LocalEngine(Engine):
    """Batched autoregressive sampling with a KV cache on odcfn's pure-function model.

    ``model``: the ``odcfn.Model`` the trainer trains (``qwen_model(cfg)``, or its LoRA model
    from ``odcfn.lora.apply``: the engine then samples with the merged weights). ``cfg``: the
    ``QwenConfig`` / ``QwenMoeConfig`` that built it. ``params``: initial full (unsharded) params
    of ``model`` (a LoRA model's adapters are merged), or None until ``update_weights``.
    ``max_model_len``: prompt + completion tokens at most. ``max_batch_tokens``: the budget of
    a batch's reserved tokens (prompt + new tokens of every live sequence). ``device``,
    ``dtype``: where and in which dtype the engine computes (default CPU, the model's dtype);
    log-probs are fp32 in any case. ``tokenizer``: anything with ``decode(ids) -> str`` fills
    ``Completion.text``."""

    def __init__(
        self,
        model: odcfn.Model,
        cfg: QwenConfig,
        *,
        params: Mapping[str, Any] | None = None,
        max_model_len: int = 4096,
        max_batch_tokens: int = 16384,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        tokenizer: Any = None,
    ) -> None:
        if not isinstance(model, odcfn.Model):
            raise TypeError(f"LocalEngine: model must be an odcfn.Model, got {type(model).__name__}")
        if not isinstance(cfg, QwenConfig):
            got = type(cfg).__name__
            raise TypeError(f"LocalEngine: cfg must be a QwenConfig or QwenMoeConfig, got {got}")
        self._lora = bool(odcfn.lora.adapter_units(model))
        self.base = odcfn.lora.base_model(model) if self._lora else model
        if self.base.config_key and self.base.config_key != repr(cfg):
            raise ValueError(f"LocalEngine: model was built from another config than cfg={cfg!r} "
                             f"(model.config_key={self.base.config_key!r})")
        self.model, self.cfg = model, cfg
        self.max_model_len = check_int(max_model_len, "LocalEngine: max_model_len", at_least=2)
        self.max_batch_tokens = check_int(max_batch_tokens, "LocalEngine: max_batch_tokens", at_least=1)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"LocalEngine: dtype must be a floating torch.dtype or None, got {dtype!r}")
        self.dtype = dtype or model.dtype
        self.device = torch.device(device if device is not None else "cpu")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError("LocalEngine: tokenizer must have a decode(ids) method")
        self.tokenizer = tokenizer
        self._weights: dec.Weights | None = None
        self._version = 0
        self._closed = False
        if params is not None:
            self._load(params, None, merged=False)

    # --- weights ------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, state: odcfn.TrainState) -> None:
        """Load ``state``'s current weights; every rank calls it (it is ``odcfn.gather_params``,
        or ``odcfn.lora.gather_merged`` for a LoRA state). ``version`` becomes ``state.step``."""
        self._check_open()
        if not isinstance(state, odcfn.TrainState):
            raise TypeError(f"update_weights: state must be an odcfn.TrainState, got {type(state).__name__}")
        lora = bool(odcfn.lora.adapter_units(state.model))
        base = odcfn.lora.base_model(state.model) if lora else state.model
        if base.config_key != self.base.config_key or base.unit_names != self.base.unit_names:
            # raised on every rank alike, before the collective gather
            raise ValueError("update_weights: the state's model is not the engine's "
                             f"({base.config_key!r} vs {self.base.config_key!r})")
        # the old weights go before the new ones arrive, so a sync never holds two full copies
        # (odcfn bench --only rl-loop measures it); a failed gather leaves an engine that refuses
        # to generate rather than one with stale weights
        self._weights = None
        # the dtype train_step publishes (the default): no second publication of the shards
        full = odcfn.lora.gather_merged(state) if lora else odcfn.gather_params(state)
        self._load(full, state.router_bias, merged=True)
        self._version = int(state.step)

    def _load(self, params: Mapping[str, Any], router_bias: torch.Tensor | None, *, merged: bool) -> None:
        if not isinstance(params, Mapping):
            got = type(params).__name__
            raise TypeError(f"LocalEngine: params must be a dict keyed by unit name, got {got}")
        if self._lora and not merged:
            odcfn.check_params(self.model, params)
            params = odcfn.lora.merge(self.model, params)
        # checked in the model's dtype: a state's gathered params may come in its compute dtype
        params = odcfn.tree_map(lambda t: t.to(self.base.dtype) if isinstance(t, torch.Tensor) else t,
                                dict(params))
        odcfn.check_params(self.base, params)
        on = odcfn.tree_map(lambda t: t.to(self.device, self.dtype), params)
        bias = None if router_bias is None else router_bias.to(self.device, torch.float32).clone()
        self._weights = dec.make_weights(self.cfg, on, bias)

    # --- generation ---------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                 first_index: int = 0) -> list[Completion]:
        """``sampling.n`` completions per prompt, grouped in prompt order (``Engine.generate``)."""
        self._check_open()
        check_int(first_index, "generate: first_index", at_least=0)
        ids = check_prompts(prompts, self.cfg.vocab_size, self.max_model_len, sampling)
        if self._weights is None:
            raise RuntimeError("LocalEngine.generate: the engine has no weights yet; pass params= to the "
                               "constructor or call update_weights(state) first")
        seed = fresh_seed() if sampling.seed is None else sampling.seed
        seqs = [
            _Seq(i * sampling.n + j, i, p, min(sampling.max_tokens, self.max_model_len - len(p)),
                 None if sampling.greedy else Uniforms(sequence_generator(seed, first_index + i, j)))
            for i, p in enumerate(ids) for j in range(sampling.n)
        ]
        self._run(seqs, sampling)
        return [self._completion(s) for s in seqs]

    def score(self, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-token fp32 log-probs of given sequences under the engine's weights at
        ``temperature``, aligned as ``odcfn.log_probs`` aligns them (``[t]``: token ``t`` given
        the tokens before it; ``[0] = 0``): the prefill alone, batched under the token budget."""
        self._check_open()
        t = SamplingParams(max_tokens=1, temperature=temperature).temperature  # checks it
        if t == 0:
            raise ValueError("score: temperature must be > 0")
        ids = check_prompts(sequences, self.cfg.vocab_size, self.max_model_len + 1, SamplingParams(1))
        if self._weights is None:
            raise RuntimeError("LocalEngine.score: the engine has no weights yet")
        out: list[torch.Tensor] = []
        i = 0
        while i < len(ids):
            j, used = i + 1, len(ids[i])
            while j < len(ids) and used + len(ids[j]) <= self.max_batch_tokens:
                used, j = used + len(ids[j]), j + 1
            lens = [len(s) for s in ids[i:j]]
            cache = dec.KVCache(self.cfg, self.dtype, self.device)
            cache.rebuild([], 0, j - i, max(lens))
            flat = torch.tensor([x for s in ids[i:j] for x in s], device=self.device)
            h_TxD, _ = dec.prefill(self._weights, cache, range(j - i), flat, lens, every_position=True)
            z_TxV = dec.logits(self._weights, h_TxD) / t
            lp_T = token_logprobs(z_TxV[:-1], flat[1:]).cpu()  # position t predicts token t + 1
            at = 0
            for n in lens:
                out.append(torch.cat([torch.zeros(1), lp_T[at: at + n - 1]]))
                at += n
            i = j
        return out

    def _run(self, seqs: list[_Seq], sampling: SamplingParams) -> None:
        w, cache = self._weights, dec.KVCache(self.cfg, self.dtype, self.device)
        waiting, live = deque(seqs), []
        while waiting or live:
            new: list[_Seq] = []
            used = sum(s.reserve for s in live)
            while waiting and (used + waiting[0].reserve <= self.max_batch_tokens or not (live or new)):
                used += waiting[0].reserve
                new.append(waiting.popleft())
            if new:  # new rows after the live ones, prefilled together
                cache.rebuild(range(len(live)), max((s.cached for s in live), default=0), len(new),
                              max(s.reserve for s in live + new))
                flat = torch.tensor([t for s in new for t in s.prompt], device=self.device)
                h_SxD, routed = dec.prefill(w, cache, range(len(live), len(live) + len(new)), flat,
                                            [len(s.prompt) for s in new])
                if routed is not None:
                    for s, r in zip(new, routed.cpu().split([len(s.prompt) for s in new])):
                        s.routed.extend(r.to(torch.int32).unbind(0))
                live += new
                self._step(new, dec.logits(w, h_SxD), sampling)
            else:  # every live sequence has exactly one token not yet fed
                pos = [s.cached for s in live]
                ids_B = torch.tensor([s.tokens[-1] for s in live], device=self.device)
                pos_B = torch.tensor(pos, device=self.device)
                h_BxD, routed = dec.decode(w, cache, ids_B, pos_B, max(pos) + 1, masked=min(pos) != max(pos))
                if routed is not None:
                    for s, r in zip(live, routed.to(torch.int32).cpu().unbind(0)):
                        s.routed.append(r)
                self._step(live, dec.logits(w, h_BxD), sampling)
            keep = [b for b, s in enumerate(live) if s.finish is None]
            if len(keep) < len(live):  # finished sequences leave the batch
                live = [live[b] for b in keep]
                if live:
                    cache.rebuild(keep, max(s.cached for s in live), 0, max(s.reserve for s in live))

    def _step(self, seqs: list[_Seq], z_BxV: torch.Tensor, sampling: SamplingParams) -> None:
        """Choose each sequence's next token from its fp32 logits and record its log-prob."""
        if sampling.greedy:  # greedy reports log-probs at temperature 1
            tok_B = z_BxV.argmax(-1)
            lp_B = token_logprobs(z_BxV, tok_B)
        else:
            u_B = torch.tensor([s.uniforms.next() for s in seqs], dtype=torch.float64, device=self.device)
            tok_B, lp_B = sample_logprobs(z_BxV / sampling.temperature, u_B, sampling.top_k, sampling.top_p)
        stop = set(sampling.stop_token_ids)
        for s, t, lp in zip(seqs, tok_B.tolist(), lp_B.tolist()):  # fp32 -> float -> fp32 is exact
            s.tokens.append(t)
            s.logprobs.append(lp)
            if t in stop:
                s.finish = "stop"
            elif len(s.tokens) >= s.budget:
                s.finish = "length"

    def _completion(self, s: _Seq) -> Completion:
        tokens = torch.tensor(s.tokens, dtype=torch.long)
        routed = None
        if s.routed:  # input positions prompt + tokens[:-1]; the last repeats its neighbour
            routed = torch.stack([*s.routed, s.routed[-1]])
        text = None if self.tokenizer is None else self.tokenizer.decode(s.tokens)
        lps = torch.tensor(s.logprobs, dtype=torch.float32)
        return Completion(s.prompt_index, tokens, lps, s.finish, text=text, routed_experts=routed,
                          version=self._version)

    # --- lifetime -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("LocalEngine is closed")

    def close(self) -> None:
        self.shutdown_background()
        self._weights, self._closed = None, True

    def __repr__(self) -> str:
        kind = "MoE" if isinstance(self.cfg, QwenMoeConfig) else "dense"
        return (f"LocalEngine({kind}, version={self._version}, max_model_len={self.max_model_len}, "
                f"max_batch_tokens={self.max_batch_tokens}, device={self.device}, dtype={self.dtype})")
