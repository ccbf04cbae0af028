"""Where a rank's shards may live (``odcfn.step.devices``): one device, except an offloaded
state's trained masters in host memory with their published copies on the compute device, next
to frozen units (LoRA's base) on that device. The rule is decided from devices alone, so it is
checked here without a GPU: ``torch.device("cuda", i)`` names a device without touching one,
and in a whole step ``meta`` tensors stand in for the device (a step refuses or accepts the
state in ``check_inputs``, before any communication). The CPU path of LoRA + offload still
saves, loads and continues bit for bit."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn import lora
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.step.devices import compute_device, offloaded_copies, state_device
from odcfn.step.offload_store import store_of
from odcfn.step.prepare import check_inputs

CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
FROZEN, TRAINED = ("embed", "layers.0", "head"), ("layers.0.lora", "layers.1.lora")


def _devices(frozen, masters):
    return {**{u: frozen for u in FROZEN}, **{u: masters for u in TRAINED}}


@pytest.mark.parametrize(
    ("shards", "published", "want"),
    [
        (_devices(GPU0, GPU0), {}, GPU0),  # in memory on a GPU
        (_devices(CPU, CPU), {}, CPU),  # in memory on the CPU
        (_devices(CPU, CPU), dict.fromkeys(TRAINED, CPU), CPU),  # offloaded, CPU compute
        (_devices(GPU1, CPU), dict.fromkeys(TRAINED, GPU1), GPU1),  # LoRA + offload on a GPU
        ({u: CPU for u in TRAINED}, dict.fromkeys(TRAINED, GPU0), GPU0),  # all offloaded on a GPU
    ],
)
def test_the_legitimate_layouts_give_their_compute_device(shards, published, want):
    assert compute_device(shards, published) == want


@pytest.mark.parametrize(
    ("shards", "published", "match"),
    [
        # nothing offloaded: a LoRA state whose trained shards are host tensors is simply mixed
        (_devices(GPU0, CPU), {}, r"params\['layers.0.lora'\] is on cpu but params\['embed'\] is on cuda:0"),
        ({**_devices(GPU0, GPU0), "head": GPU1}, {}, r"params\['head'\] is on cuda:1 but .* cuda:0"),
        # an offloaded master on a device instead of host memory
        (_devices(GPU0, GPU0), dict.fromkeys(TRAINED, GPU0), r"offloaded .* its master is on cuda:0"),
        # published copies that are not where the frozen units (and so the compute) are
        (_devices(GPU0, CPU), dict.fromkeys(TRAINED, CPU), r"published copy of offloaded .* is on cpu"),
        (_devices(GPU0, CPU), {"layers.0.lora": GPU0, "layers.1.lora": GPU1}, "is on cuda:1 but"),
        ({u: CPU for u in TRAINED}, {"layers.0.lora": GPU0, "layers.1.lora": GPU1}, "is on cuda:1 but"),
        (_devices(GPU0, CPU), {"other": GPU0}, r"published copies of units \['other'\]"),
        ({}, {}, "holds no units"),
    ],
)
def test_mixed_devices_are_refused_naming_the_unit(shards, published, match):
    with pytest.raises(ValueError, match=match):
        compute_device(shards, published)


CFG = QwenConfig(vocab_size=29, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
BATCH = odcfn.random_batch([5, 9, 7, 4], CFG.vocab_size, seed=0)


def _lora_state(tr, off, **config):
    base = qwen_model(CFG), init_params(CFG, seed=3)
    model, params = lora.apply(*base, rank=2, alpha=4, targets=("q_proj",))
    return odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.adamw(1e-2), transport=tr,
                                   config=odcfn.StepConfig(offload=off, deterministic=True, **config))


def _on_meta(state, copies=True):
    """``state`` as it is on a GPU, with ``meta`` for the device: its frozen units there and
    (``copies``) its offloaded units' published copies, their masters still host views."""
    frozen = {u: state.params[u].to("meta") for u in state.model.frozen}
    state = state.replace(params={**state.params, **frozen})
    if copies:
        trained = [u for u in state.model.unit_names if u not in state.model.frozen]
        store = store_of(state.params, state.opt_state, trained)
        store.published = {u: t.to("meta") for u, t in store.published.items()}
    return state


def test_a_step_accepts_lora_with_offloaded_masters_on_host_and_the_rest_on_the_device(tmp_path):
    def fn(rank, tr):
        state = _lora_state(tr, odcfn.Offload(path=tmp_path, budget_gib=0.001))
        assert offloaded_copies(state) and state_device(state) == CPU
        gpu = _on_meta(state)
        assert state_device(gpu) == torch.device("meta")
        check_inputs(gpu, BATCH)  # the old one-device check refused this state
        calls = dict(tr.collectives.calls)
        # genuinely mixed: the base on the device but the published copies left on the host
        with pytest.raises(ValueError, match="published copy of offloaded .* is on cpu but .* meta"):
            check_inputs(_on_meta(_lora_state(tr, odcfn.Offload(path=tmp_path, budget_gib=0.001)),
                                  copies=False), BATCH)
        # and without offload, a base on the device next to host LoRA shards is refused as before
        plain = _on_meta(_lora_state(tr, None), copies=False)
        with pytest.raises(ValueError, match="is on cpu but .* is on meta: all shards of a rank live on one"):
            check_inputs(plain, BATCH)
        return calls == dict(tr.collectives.calls) and tr.counters.gathers == 0  # nothing communicated

    assert all(odcfn.run_local(fn, 2, timeout=60))


def test_lora_with_offload_on_cpu_saves_loads_and_continues_bit_for_bit(tmp_path):
    (tmp_path / "tier").mkdir()
    off = odcfn.Offload(path=tmp_path / "tier", budget_gib=0.001)
    batches = [odcfn.random_batch([5, 9, 7, 4], CFG.vocab_size, seed=s) for s in range(4)]

    def fn(rank, tr):
        s = _lora_state(tr, off)
        for b in batches:
            s, _ = odcfn.train_step(s, b)
        r = _lora_state(tr, off)
        for b in batches[:2]:
            r, _ = odcfn.train_step(r, b)
        odcfn.save(tmp_path / "ck", r)
        r = odcfn.load(tmp_path / "ck", _lora_state(tr, off))
        assert offloaded_copies(r) and state_device(r) == CPU  # back in a store, published on the CPU
        for b in batches[2:]:
            r, _ = odcfn.train_step(r, b)
        return all(torch.equal(s.params[k], r.params[k]) for k in s.params) and all(
            torch.equal(s.opt_state["nu"][k], r.opt_state["nu"][k]) for k in s.opt_state["nu"])

    assert all(odcfn.run_local(fn, 2, timeout=60))
