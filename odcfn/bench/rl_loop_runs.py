"""The ranks' side of ``odcfn bench --only rl-loop`` (summarised by ``odcfn.bench.rl_loop``).

One launched job of W processes (``ShmTransport``, one torch thread each) runs three parts:

- ``iteration``: one ``odcfn.rl.step`` with ``LocalEngine`` rollouts of long-tailed lengths
  (stop tokens: a random model ends a completion with chance ``1/stop_every`` per token, so
  lengths are geometric, capped by ``max_tokens``), ODC+LB-Mini against Collective+LB-Micro.
  Both contenders start every repeat from the same state at the same weights with the same
  sampling seed, so they get the same rollouts (checked: a digest of every generated token);
  the order alternates per repeat, so load from other jobs falls on both alike.
- ``sync``: ``LocalEngine.update_weights(state)`` (every rank) against ``gather_params(state,
  dst=0)`` + ``load_state_dict`` into transformers' model of the same config (rank 0), time and
  the peak of live tensor bytes above what was alive before (``LiveBytes``), plus the RSS peak.
- ``async``: whole runs of ``n_iters`` iterations of a learning task (first new token = 5,
  chance 1/16), synchronous and one-step asynchronous, interleaved; iterations per second and
  the per-iteration mean reward of each.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from odcfn.models import QwenConfig

__all__ = ["CONTENDERS", "LiveBytes", "LoopSpec", "loop_worker", "rank_loop"]

# (name, StepConfig.comm, StepConfig.balance): verl's baseline and ODC with free per-rank counts
CONTENDERS = (("collective+lb-micro", "collective", "lb_micro"), ("odc+lb-mini", "odc", "lb_mini"))


def _cfg(d_model: int, n_layers: int, vocab: int) -> QwenConfig:
    heads = max(1, d_model // 32)
    return QwenConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=heads,
                      n_kv_heads=max(1, heads // 2), d_ff=3 * d_model)


@dataclass(frozen=True)
class LoopSpec:
    """What one run of the section does (``LoopSpec.shape("full" | "quick" | "tiny")``)."""

    world_size: int = 2
    # iteration: the model, the rollouts and the update
    d_model: int = 128
    n_layers: int = 4
    vocab: int = 1024
    prompts: int = 8
    prompt_len: int = 16
    group_size: int = 4
    max_tokens: int = 256
    stop_every: int = 64
    ppo_mini_batches: int = 2
    repeats: int = 5
    # sync: a larger model, so bytes (not per-call overheads) make the time
    sync_d_model: int = 512
    sync_n_layers: int = 4
    sync_vocab: int = 8192
    sync_repeats: int = 5
    # async: the learning task
    async_runs: int = 3
    async_iters: int = 12
    async_max_tokens: int = 24  # generation about as long as the update here
    seed: int = 0
    timeout: float = 600.0

    @staticmethod
    def shape(name: str, world_size: int = 2) -> LoopSpec:
        if name == "full":
            return LoopSpec(world_size=world_size)
        if name == "quick":
            return LoopSpec(world_size=world_size, d_model=64, n_layers=2, vocab=512, prompts=4,
                            max_tokens=128, stop_every=32, repeats=2, sync_d_model=256, sync_vocab=4096,
                            sync_repeats=2, async_runs=1, async_iters=8)
        if name == "tiny":  # the tests': seconds, figures meaningless
            return LoopSpec(world_size=world_size, d_model=32, n_layers=1, vocab=64, prompts=2, prompt_len=4,
                            group_size=2, max_tokens=16, stop_every=8, repeats=1, sync_d_model=64,
                            sync_n_layers=1, sync_vocab=128, sync_repeats=1, async_runs=1, async_iters=3,
                            async_max_tokens=3, timeout=180.0)
        raise ValueError(f"LoopSpec.shape: unknown shape {name!r}; expected 'full', 'quick' or 'tiny'")

    @property
    def cfg(self) -> QwenConfig:
        return _cfg(self.d_model, self.n_layers, self.vocab)

    @property
    def sync_cfg(self) -> QwenConfig:
        return _cfg(self.sync_d_model, self.sync_n_layers, self.sync_vocab)

    @property
    def max_tokens_per_microbatch(self) -> int:
        return 2 * (self.prompt_len + self.max_tokens)  # two long samples, or many short ones


class LiveBytes(TorchDispatchMode):
    """Peak bytes alive over a block above what was alive before it: each op's new output
    storages count while they live (weakly held), and the storages of ``watched`` tensors (ones
    that predate the block, such as an engine's old weights) count as freed once they die. The
    allocator and other processes do not enter; ops run in other threads are not seen."""

    def __init__(self, watched: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.watched = {StorageWeakRef(t.untyped_storage()).cdata: (StorageWeakRef(t.untyped_storage()),
                                                                     t.untyped_storage().nbytes())
                        for t in watched}
        self.current = self.peak = 0

    def _sweep(self) -> None:
        for table, sign in ((self.live, -1), (self.watched, -1)):
            for k in [k for k, (ref, _) in table.items() if ref.expired()]:
                self.current += sign * table.pop(k)[1]
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        inputs = {StorageWeakRef(t.untyped_storage()).cdata
                  for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.live and ref.cdata not in inputs and ref.cdata not in self.watched:
                    self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
                    self.current += t.untyped_storage().nbytes()
        self._sweep()
        return out

    def __exit__(self, *exc: Any) -> None:
        self._sweep()
        super().__exit__(*exc)


def _short_reward(max_tokens: int) -> Callable[[Any, Any], float]:
    def reward(prompt: Any, completion: Any) -> float:  # verl's AIME: right answers run shorter
        return float(completion.finish_reason == "stop" and completion.tokens.numel() <= max_tokens // 4)

    return reward


def target_reward(prompt: Any, completion: Any) -> float:
    """The async part's task: 1 when the first new token is 5 (chance 1/16 at the start)."""
    return float(int(completion.tokens[0]) == 5)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list:
    from odcfn.rl import Prompt

    g = torch.Generator().manual_seed(seed)
    return [Prompt(torch.randint(1, vocab, (length,), generator=g).tolist()) for _ in range(n)]


def _engine_class():
    from odcfn.rollout import LocalEngine

    class Digest(LocalEngine):
        """A ``LocalEngine`` that hashes every token it generates (the rollouts' identity)."""

        digest = hashlib.sha256()

        def generate(self, prompts, sampling, *, first_index=0):
            out = super().generate(prompts, sampling, first_index=first_index)
            for c in out:
                self.digest.update(c.tokens.numpy().tobytes() + b"|")
            return out

    return Digest


def _state(cfg, params, tr, comm: str, balance: str, mtpm: int, lr: float, loss):
    import odcfn
    from odcfn.models import qwen_model

    extra = {} if loss is None else {"loss": loss}
    return odcfn.TrainState.create(
        params=params, model=qwen_model(cfg), optimizer=odcfn.adamw(lr, weight_decay=0.0), transport=tr,
        config=odcfn.StepConfig(comm=comm, balance=balance, max_tokens_per_microbatch=mtpm, **extra))


def iteration_part(spec: LoopSpec, tr: Any, barrier: Callable[[], None], log: Callable[[str], None]) -> list:
    """Per repeat and contender: the iteration's timings, response lengths, samples per rank
    per update and the rollouts' digest."""
    import odcfn
    from odcfn import rl
    from odcfn.models import init_params
    from odcfn.rollout import SamplingParams

    cfg = spec.cfg
    params = init_params(cfg, seed=spec.seed)
    loss = odcfn.losses.policy_gradient(clip_ratio_high=0.28)
    states = {name: _state(cfg, params, tr, comm, bal, spec.max_tokens_per_microbatch, 1e-3, loss)
              for name, comm, bal in CONTENDERS}
    stops = tuple(range(0, spec.vocab, spec.stop_every))
    config = rl.RLConfig(reward=_short_reward(spec.max_tokens), group_size=spec.group_size, loss=loss,
                         ppo_mini_batches=spec.ppo_mini_batches,
                         sampling=SamplingParams(max_tokens=spec.max_tokens, stop_token_ids=stops))
    engine = _engine_class()(states[CONTENDERS[0][0]].model, cfg,
                             max_model_len=spec.prompt_len + spec.max_tokens)
    out = []
    for r in range(1 + spec.repeats):  # repeat 0 warms up (first-call allocations, plan caches)
        prompts = _prompts(spec.prompts, spec.prompt_len, spec.vocab, seed=spec.seed * 1000 + r)
        order = CONTENDERS if r % 2 else CONTENDERS[::-1]
        for name, _, _ in order:
            engine.update_weights(states[name])  # the same weights for both: the repeat's start
            engine.digest = hashlib.sha256()
            barrier()
            c0 = time.process_time()
            _, m = rl.step(states[name], engine, prompts, config)
            cpu = time.process_time() - c0
            x = m.extra
            out.append({
                "repeat": r, "warmup": r == 0, "contender": name, "digest": engine.digest.hexdigest(),
                "cpu_s": cpu, **{k: x[k] for k in x if k.startswith(("timing_s/", "response_length/"))},
                "score_mean": x["critic/score/mean"], "total_tokens": x["perf/total_num_tokens"],
                "samples_per_rank": [sum(len(mb) for mb in u.plan.microbatches) for u in m.updates],
            })
        log(f"   iteration repeat {r}/{spec.repeats}{' (warmup)' if r == 0 else ''} done")
    engine.close()
    return out


def _sync_once(what: str, state: Any, engine: Any, hf: Any, watch: bool) -> dict:
    import odcfn
    from odcfn.bench.memory import PeakRSS
    from odcfn.models.hf_names import hf_state_dict

    rank = state.mesh.rank
    if what == "engine":
        old = tree_leaves(engine._weights.params) if watch and engine._weights is not None else []
        fn = lambda: engine.update_weights(state)  # noqa: E731
    else:
        old = []

        def fn() -> None:
            full = odcfn.gather_params(state, dst=0)
            if rank == 0:
                hf.load_state_dict(hf_state_dict(full), strict=True)

    if not watch:
        t0 = time.perf_counter()
        fn()
        return {"wall_s": time.perf_counter() - t0}
    tracker = LiveBytes(old)
    del old  # the tracker holds them weakly: the engine's old weights may go once replaced
    with PeakRSS() as rss, tracker as live:
        fn()
    return {"live_peak_bytes": live.peak, "live_after_bytes": live.current,
            "rss_peak_bytes": rss.peak - rss.base}


def sync_part(spec: LoopSpec, tr: Any, barrier: Callable[[], None], log: Callable[[str], None]) -> dict:
    """The engine's sync against gather-to-one-rank + ``load_state_dict``: times per repeat,
    then one sync of each under the memory trackers."""
    import tempfile

    import transformers

    from odcfn.models import init_params, to_hf
    from odcfn.rollout import LocalEngine

    cfg = spec.sync_cfg
    params = init_params(cfg, seed=spec.seed)
    state = _state(cfg, params, tr, "odc", "lb_mini", 4096, 1e-3, None)
    model_bytes = sum(t.numel() * t.element_size() for t in tree_leaves(params))
    hf = None
    if state.mesh.rank == 0:
        with tempfile.TemporaryDirectory() as d:
            to_hf(d, params, cfg)
            hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).train(False)
    del params
    engine = LocalEngine(state.model, cfg)
    times: dict[str, list[float]] = {"engine": [], "gather_load": []}
    for r in range(1 + spec.sync_repeats):
        for what in (("engine", "gather_load") if r % 2 else ("gather_load", "engine")):
            barrier()
            t = _sync_once(what, state, engine, hf, watch=False)["wall_s"]
            if r:
                times[what].append(t)
    memory = {}
    for _ in range(2):  # the first tracked call pays the trackers' own first-use allocations
        for what in ("engine", "gather_load"):
            barrier()
            memory[what] = _sync_once(what, state, engine, hf, watch=True)
    log("   weight sync done")
    engine.close()
    return {"model_bytes": model_bytes, "num_params": cfg.num_params,
            "wall_s": times, "memory": memory}


def thread_schedstat() -> tuple[float, float] | None:
    """This thread's ``(seconds on a CPU, seconds runnable but waiting for one)`` from Linux's
    schedstat, or None where there is none. Wall time minus both is the time it slept: waiting
    for a peer, a lock or the GIL, which an overlapped generation could use."""
    import threading

    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
    except OSError:
        return None
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


def async_part(spec: LoopSpec, tr: Any, barrier: Callable[[], None], log: Callable[[str], None]) -> list:
    """Whole runs, sync and async interleaved (s a a s s a ...): per run its wall time, CPU
    time, the per-iteration mean rewards and the mean timing split."""
    import odcfn
    from odcfn import rl
    from odcfn.models import init_params
    from odcfn.rollout import LocalEngine, SamplingParams

    cfg = QwenConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    params = init_params(cfg, seed=3)
    modes = [("sync", "async") if i % 2 == 0 else ("async", "sync") for i in range(spec.async_runs)]
    out = []
    for i, pair in enumerate(modes):
        for mode in pair:
            asynchronous = mode == "async"
            loss = odcfn.losses.policy_gradient(decoupled=asynchronous, clip_ratio_high=0.28)
            config = rl.RLConfig(reward=target_reward, group_size=8, loss=loss, async_rollouts=asynchronous,
                                 sampling=SamplingParams(max_tokens=spec.async_max_tokens), seed=i)
            state = _state(cfg, params, tr, "odc", "lb_mini", 4096, 1e-2, loss)
            engine = LocalEngine(state.model, cfg)
            engine.update_weights(state)
            prompts = [_prompts(8, 4, 16, seed=10_000 * i + it) for it in range(spec.async_iters + 1)]
            scores, split = [], {}
            barrier()
            t0, c0, s0 = time.perf_counter(), time.process_time(), thread_schedstat()
            for it in range(spec.async_iters):
                nxt = prompts[it + 1] if asynchronous and it + 1 < spec.async_iters else None
                state, m = rl.step(state, engine, prompts[it], config, next_prompts=nxt)
                scores.append(m.extra["critic/score/mean"])
                for k, v in m.extra.items():
                    if k.startswith("timing_s/"):
                        split.setdefault(k, []).append(v)
            wall, cpu, s1 = time.perf_counter() - t0, time.process_time() - c0, thread_schedstat()
            engine.close()
            sched = None if s0 is None or s1 is None else {  # the loop's (main) thread
                "run_s": s1[0] - s0[0], "runqueue_s": s1[1] - s0[1],
                "slept_s": max(0.0, wall - (s1[0] - s0[0]) - (s1[1] - s0[1]))}
            out.append({"run": i, "mode": mode, "wall_s": wall, "cpu_s": cpu, "scores": scores,
                        "main_thread": sched,
                        "timing_mean_s": {k: statistics.mean(v) for k, v in split.items()}})
        log(f"   async run {i + 1}/{spec.async_runs} done")
    return out


def rank_loop(spec: LoopSpec, tr: Any, barrier: Callable[[], None], progress: bool = False) -> dict:
    rank = tr.mesh.rank

    def log(msg: str) -> None:
        if progress and rank == 0:
            import sys

            sys.stderr.write(msg + "\n")
            sys.stderr.flush()

    return {"iteration": iteration_part(spec, tr, barrier, log), "sync": sync_part(spec, tr, barrier, log),
            "async": async_part(spec, tr, barrier, log)}


def loop_worker(spec: LoopSpec, progress: bool = False) -> dict:
    """Entry point of one launched rank."""
    import torch.distributed as dist

    from odcfn.sharding import Mesh
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)  # W ranks on the machine's cores: one thread each
    mesh = Mesh.from_env()
    with ShmTransport(mesh, timeout=spec.timeout) as tr:
        return rank_loop(spec, tr, dist.barrier, progress)
