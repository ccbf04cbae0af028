"""What ``VLLMEngine`` runs inside vLLM's worker process (its ``worker_extension_cls``).

vLLM mixes this class into its worker, so its methods see ``self.model_runner`` and are called
by name through ``LLM.collective_rpc``. This module imports nothing from vLLM at import time:
the worker process imports it by its qualified name, and ``odcfn.rollout`` must stay importable
without vLLM.

Weights arrive bucket by bucket through one shared-memory file the trainer side writes and this
process maps for the duration of a sync (vLLM's RPC would copy tensors several times, and its
untyped arguments arrive as raw ``[dtype, shape, buffer index]`` lists). A bucket's description,
``[(Hugging Face name, dtype, shape, byte offset)]``, is the RPC's argument; it holds
whole vLLM modules (a layer's q/k/v together, a sparse layer's experts together): vLLM's
in-place reload (``model_runner.reload_weights``) moves every module to the meta device, loads
what it is given, then puts back the old kernel tensors of any module that got nothing. A
module that got only part of its weights would be rebuilt with the rest uninitialised, so the
trainer side never splits one. Every bucket is a separate reload, so vLLM's "not loaded"
warnings for the other modules are expected noise; they are muted during a sync and replaced
by one check at its end that every parameter of the model was loaded by some bucket.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["WeightSyncExtension", "peak_rss_bytes", "reset_peak_rss"]

# vLLM's loggers whose per-bucket warnings (modules the bucket did not cover) are expected
_NOISY = tuple(f"vllm.model_executor.model_loader.reload.{m}" for m in ("layerwise", "inplace"))
_NOISE = ("Failed to load weights", "Following weights were not loaded")


class _MuteMissing(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(s in str(record.msg) for s in _NOISE)


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set (VmHWM) to its current size (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_status(key: str) -> int:
    """A byte-sized field of this process's /proc/self/status (``VmRSS``, ``VmHWM``, ``VmData``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> tuple[int, int]:
    """(current RSS, peak RSS since the last ``reset_peak_rss``) of this process, in bytes."""
    return proc_status("VmRSS"), proc_status("VmHWM")


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _redo_cpu_expert_prepack(model: torch.nn.Module, loaded: set[str]) -> None:
    """Repack the reloaded experts of vLLM's CPU MoE kernel.

    vLLM 0.32's unquantized MoE method runs its experts' ``process_weights_after_loading`` (on
    CPU: ``cpu_prepack_moe_weight``, the grouped-gemm layout its kernel reads) only when the
    kernel is first built, not on a weight update; after an in-place reload the experts then
    hold checkpoint-layout weights the CPU kernel misreads (measured: log-probs off by ~0.1).
    So the step is run here for every CPU-kernel expert module this bucket loaded."""
    for name, mod in model.named_modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not type(experts).__module__.endswith("cpu_moe"):
            continue
        if any(f"{name}.{p}" in loaded for p, _ in mod.named_parameters(recurse=False)):
            experts.process_weights_after_loading(mod)


class WeightSyncExtension:
    """Methods vLLM's worker gains: the behaviour log-probs hook and bucketed weight loading."""

    model_runner: Any  # vLLM's, set by the worker this class is mixed into

    def odcfn_install_behaviour_logprobs(self) -> bool:
        """Make the log-probs vLLM reports for sampled tokens the ones after temperature and
        before top-k/top-p.

        vLLM's ``logprobs_mode="processed_logprobs"`` (which the engine is started with) returns
        them after temperature *and after* top-k/top-p filtering, renormalised over the kept
        tokens; ``raw_logprobs`` returns them before temperature. Neither is the behaviour
        policy of the RL objective once top-k/top-p are on, so the filter step's own return is
        replaced by the log-softmax of the logits it receives, which vLLM's sampler has already
        divided by the temperature (greedy rows by 1). Returns False when this vLLM's sampler
        has another shape (then only requests without top-k/top-p get exact log-probs)."""
        sampler = getattr(getattr(self.model_runner, "sampler", None), "topk_topp_sampler", None)
        inner = getattr(sampler, "forward", None)
        if inner is None or getattr(inner, "_odcfn_behaviour", False):
            return inner is not None

        def forward(logits: torch.Tensor, generators: Any, k: Any, p: Any) -> tuple[torch.Tensor, Any]:
            lp = logits.log_softmax(dim=-1, dtype=torch.float32)  # before the filter edits logits in place
            sampled, _ = inner(logits, generators, k, p)
            return sampled, lp

        forward._odcfn_behaviour = True  # type: ignore[attr-defined]
        sampler.forward = forward
        return True

    def odcfn_begin_sync(self, path: str, nbytes: int) -> None:
        """Map the trainer's bucket file (``nbytes`` long) for this sync."""
        self._odcfn_buf = torch.from_file(path, shared=True, size=int(nbytes), dtype=torch.uint8)
        model = self.model_runner.get_model()
        self._odcfn_expected = {n for n, _ in model.named_parameters()}
        self._odcfn_loaded: set[str] = set()
        self._odcfn_filter = _MuteMissing()
        for name in _NOISY:
            logging.getLogger(name).addFilter(self._odcfn_filter)
        reset_peak_rss()
        self._odcfn_rss0 = peak_rss_bytes()[0]

    def odcfn_load_bucket(self, meta: Iterable[tuple[str, str, list[int], int]]) -> int:
        """Load one bucket in place from the mapped file; returns how many tensors it held."""
        buf = self._odcfn_buf
        pairs = []
        for name, dtype, shape, off in meta:
            dt = getattr(torch, dtype)
            n = _numel(shape) * torch.empty((), dtype=dt).element_size()
            pairs.append((str(name), buf[off: off + n].view(dt).view(*shape)))
        model = self.model_runner.get_model()
        loaded: set[str] = set()
        original = model.load_weights

        def load_weights(it: Iterable[tuple[str, torch.Tensor]]) -> Any:
            got = original(it)
            if got is not None:
                loaded.update(got)
            return got

        model.load_weights = load_weights  # an instance attribute: reload_weights calls this one
        try:
            self.model_runner.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)
        finally:
            del model.load_weights
        _redo_cpu_expert_prepack(model, loaded)
        self._odcfn_loaded |= loaded
        return len(pairs)

    def odcfn_end_sync(self) -> dict[str, Any]:
        """Unmap, unmute, and report what no bucket loaded plus this process's memory during the sync."""
        self._odcfn_buf = None
        for name in _NOISY:
            logging.getLogger(name).removeFilter(self._odcfn_filter)
        missing = sorted(self._odcfn_expected - self._odcfn_loaded)
        rss, peak = peak_rss_bytes()
        return {"missing": missing, "rss_before": self._odcfn_rss0, "rss": rss, "peak_rss": peak,
                "pid": os.getpid()}

    def odcfn_memory(self) -> tuple[int, int]:
        return peak_rss_bytes()

    def odcfn_save_parameters(self, path: str) -> int:
        """Write the model's parameters as vLLM holds them (``torch.save`` of ``{name: tensor}``):
        a debugging aid to see what a reload changed. Returns how many were written."""
        params = {n: p.detach().cpu() for n, p in self.model_runner.get_model().named_parameters()}
        torch.save(params, path)
        return len(params)
