"""LoRA and frozen units beyond PEFT parity: PEFT's initialisation, the sharded step against a
single-process reference for random targets/ranks/alphas/world sizes/balancers (a property),
checkpoints that hold only the adapters and refuse another base, the multi-process path (shm,
one PEFT writer), and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import odcfn
from odcfn import lora
from odcfn.checkpoint.frozen import trained_model
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.transport.shm import ShmTransport
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture

CFG = QwenConfig(vocab_size=29, d_model=12, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=20)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora(cfg=CFG, seed=0, **kw):
    kw.setdefault("rank", 2)
    kw.setdefault("alpha", 4.0)
    model, params = lora.apply(qwen_model(cfg), init_params(cfg, seed=seed), **kw)
    g = torch.Generator().manual_seed(seed + 1)  # non-zero B: every adapter leaf gets a gradient
    for name in lora.adapter_units(model):
        params[name] = odcfn.tree_map(lambda x: torch.randn(x.shape, generator=g) * 0.2, params[name])
    return model, params


def _value_and_grad(model, params, batch):
    """The single-process reference: plain autograd on the unsharded params."""
    p = odcfn.tree_map(lambda x: x.detach().clone().requires_grad_(), params)
    loss = odcfn.reference_loss(model, p, batch)
    loss.backward()
    return loss.detach(), odcfn.tree_map(lambda x: torch.zeros_like(x) if x.grad is None else x.grad, p)


def test_init_is_peft_s_and_the_model_starts_equal_to_the_base():
    base, full = qwen_model(CFG), init_params(CFG)
    model, params = lora.apply(base, full, rank=3, alpha=6, targets=("q_proj", "down_proj"), seed=5)
    again = lora.apply(base, full, rank=3, alpha=6, targets=("q_proj", "down_proj"), seed=5)[1]
    assert model.frozen == base.unit_names and lora.spec(model).scale == 2.0
    assert lora.spec(lora.apply(base, full, rank=4, alpha=6, use_rslora=True)[0]).scale == 3.0
    a = params["lora.layers.0"]["mlp"]["down_proj"]["lora_A"]
    assert a.shape == (3, CFG.d_ff) and float(a.abs().max()) <= 1 / math.sqrt(CFG.d_ff)
    assert float(a.abs().max()) > 0.8 / math.sqrt(CFG.d_ff)  # uniform over the whole bound
    assert torch.equal(a, again["lora.layers.0"]["mlp"]["down_proj"]["lora_A"])  # seeded
    assert not params["lora.layers.1"]["self_attn"]["q_proj"]["lora_B"].any()
    assert params["layers.0"] is full["layers.0"]  # the base tensors, not copies
    batch = odcfn.random_batch([7, 4], CFG.vocab_size, seed=1)
    assert float(odcfn.reference_loss(model, params, batch)) == float(odcfn.reference_loss(base, full, batch))
    assert lora.base_model(model).unit_names == base.unit_names


@settings(max_examples=10)
@given(
    targets=st.lists(st.sampled_from(PROJ), min_size=1, max_size=4, unique=True),
    rank=st.integers(1, 4),
    alpha=st.floats(0.5, 16),
    rslora=st.booleans(),
    world=st.integers(1, 4),
    balance=st.sampled_from(["lb_mini", "lb_micro", "local_sort", "round_robin"]),
    comm=st.sampled_from(["odc", "collective"]),
    tied=st.booleans(),
    hybrid=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sharded_lora_step_equals_single_process(
    targets, rank, alpha, rslora, world, balance, comm, tied, hybrid, seed
):
    cfg = QwenConfig(**{**CFG.__dict__, "tie_embeddings": tied})
    model, params = _lora(cfg, seed, rank=rank, alpha=alpha, targets=targets, use_rslora=rslora)
    lengths = [3 + (seed >> i) % 9 for i in range(5)]
    batch = odcfn.random_batch(lengths, cfg.vocab_size, seed=seed)
    loss, ref = _value_and_grad(model, params, batch)
    config = odcfn.StepConfig(comm=comm, balance=balance, max_tokens_per_microbatch=12)

    def fn(rank_, t):
        state = odcfn.TrainState.create(
            params=params, model=model, optimizer=odcfn.sgd(0.0), transport=t, config=config
        )
        return odcfn.grad_step(state, batch)

    hybrid = hybrid and world in (2, 4)  # shard inside nodes of 2 ranks, replicate across them
    kw = {"ranks_per_node": world // 2, "sharding": "hybrid"} if hybrid else {}
    outs = odcfn.run_local(fn, world, timeout=60, **kw)
    mesh = odcfn.Mesh(world, 0, world // 2 if hybrid else None, "hybrid" if hybrid else "full")
    group = [outs[r][0] for r in mesh.shard_group]  # one full copy: rank 0's shard group
    got = odcfn.unshard(group, trained_model(model), mesh)
    # fp32 sums in another order: relative error ~1e-6 of the gradient's scale
    for unit in lora.adapter_units(model):
        for ga, gb in zip(odcfn.tree.tree_leaves(got[unit]), odcfn.tree.tree_leaves(ref[unit])):
            assert float((ga - gb).norm()) <= 1e-5 * float(gb.norm()) + 1e-7, unit
    for r in range(world):  # every replica holds the same shards
        assert set(outs[r][0]) == set(lora.adapter_units(model))
    assert abs(outs[0][1].loss - float(loss)) <= 1e-5 * abs(float(loss))
    assert all(o[1].counters.syncs == 1 for o in outs)


def _train(model, params, transport, steps=2):
    state = odcfn.TrainState.create(
        params=params,
        model=model,
        optimizer=odcfn.adamw(1e-2),
        transport=transport,
        config=odcfn.StepConfig(balance="lb_mini"),
    )
    for i in range(steps):
        state, _ = odcfn.train_step(state, odcfn.random_batch([6, 9, 4], model.vocab_size, seed=i))
    return state


def test_checkpoint_holds_adapters_only_and_refuses_another_base(tmp_path):
    model, params = _lora(targets=PROJ)
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"the base weights")
    (base / "config.json").write_text("{}")

    def save(rank, t):
        state = _train(model, params, t)
        odcfn.save(tmp_path / "ck", state, base=base)
        return state

    states = odcfn.run_local(save, 2, timeout=60)
    doc = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert set(doc["units"]) == set(lora.adapter_units(model))  # no frozen unit is written
    assert set(doc["extra"]["frozen_base"]["sha256"]) == {"model.safetensors", "config.json"}

    def load(rank, t):  # resharded onto three ranks: adapters and moments come back, base kept
        fresh = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.adamw(1e-2), transport=t)
        return odcfn.load(tmp_path / "ck", fresh)

    loaded = odcfn.run_local(load, 3, timeout=60)
    want = odcfn.unshard([s.params for s in states], model, odcfn.Mesh(2, 0))
    got = odcfn.unshard([s.params for s in loaded], model, odcfn.Mesh(3, 0))
    assert odcfn.tree_allclose(got, want, rtol=0, atol=0)
    assert set(loaded[0].opt_state["mu"]) == set(lora.adapter_units(model)) and loaded[0].step == 2
    (base / "model.safetensors").write_bytes(b"another base")
    with pytest.raises(ValueError, match=r"model\.safetensors differs"):
        odcfn.run_local(load, 1, timeout=60)
    (base / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors is missing"):
        odcfn.run_local(load, 1, timeout=60)


def shm_worker(path):
    """Two AdamW steps on ShmTransport, then save_peft (one writer) and adapter-only sync."""
    model, params = _lora(targets=("q_proj", "v_proj"))
    mesh = odcfn.Mesh.from_env()
    with ShmTransport(mesh, timeout=30) as tr:
        state = _train(model, params, tr)
        written = lora.save_peft(path, state)
        adapters = odcfn.lora.gather_adapters(state)
        merged = odcfn.lora.gather_merged(state, 0)
        full = odcfn.gather_params(state)
    return written, adapters, merged, full, {k: v.clone() for k, v in state.params.items()}


def test_multi_process_lora_saves_one_peft_copy_and_syncs_adapters(mp_pool, tmp_path):  # noqa: F811
    model, params = _lora(targets=("q_proj", "v_proj"))
    out = mp_pool.run(shm_worker, 2, args=(str(tmp_path / "peft"),))
    assert out[0][0] is not None and out[1][0] is None  # rank 0 alone writes
    ref = odcfn.run_local(lambda r, t: _train(model, params, t).params, 2, timeout=60)
    for r in range(2):  # processes over shared memory == threads
        assert odcfn.tree_allclose(out[r][4], ref[r], rtol=1e-6, atol=1e-7)
    full = out[0][3]
    assert set(out[1][1]) == set(lora.adapter_units(model))  # only the adapters travel
    assert out[1][2] is None and set(out[0][2]) == set(qwen_model(CFG).unit_names)
    assert odcfn.tree_allclose(out[0][2], lora.merge(model, full), rtol=0, atol=0)
    loaded = lora.load_peft(tmp_path / "peft", model, params)
    assert odcfn.tree_allclose({k: loaded[k] for k in out[0][1]}, out[0][1], rtol=0, atol=0)


def test_bad_input_is_named():
    base, full = qwen_model(CFG), init_params(CFG)
    with pytest.raises(ValueError, match=r"targets \['qkv_proj'\].*'q_proj'"):
        lora.apply(base, full, rank=2, alpha=4, targets=("q_proj", "qkv_proj"))
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        lora.apply(base, full, rank=0, alpha=4)
    with pytest.raises(TypeError, match="rank"):
        lora.apply(base, full, rank=2.0, alpha=4)
    for alpha in (0, -1.0, math.inf):
        with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
            lora.apply(base, full, rank=2, alpha=alpha)
    with pytest.raises(ValueError, match=r"dropout must be a number in \[0, 1\)"):
        lora.apply(base, full, rank=2, alpha=4, dropout=1.0)
    model, params = lora.apply(base, full, rank=2, alpha=4)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora.apply(model, params, rank=2, alpha=4)
    with pytest.raises(ValueError, match="trainable splits unit 'layers.0'"):
        odcfn.trainable.freeze(base, ("layers.0.mlp.*",))
    with pytest.raises(ValueError, match="freezes every unit"):
        odcfn.trainable.freeze(base, lambda name: False)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora.merge(base, full)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("use_dora", True, "use_dora=True is not implemented"),
        ("r", 3, "r=3 but the model was built with 2"),
        ("target_modules", ["q_proj"], "target_modules="),
        ("bias", "all", "bias='all' is not implemented"),
        ("lora_alpha", 5, "lora_alpha=5"),
        ("target_modules", ".*proj", "only a list"),
    ],
)
def test_unsupported_or_mismatched_peft_config_is_named(tmp_path, field, value, match):
    model, params = _lora(targets=("q_proj", "v_proj"))
    state_dir = tmp_path / "a"
    state_dir.mkdir()
    from safetensors.torch import save_file

    save_file(lora.peft_state_dict(model, params), str(state_dir / "adapter_model.safetensors"))
    conf = {
        "peft_type": "LORA",
        "r": 2,
        "lora_alpha": 4,
        "target_modules": ["q_proj", "v_proj"],
        field: value,
    }
    (state_dir / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="adapter_config.json") as e:
        lora.load_peft(state_dir, model, params)
    assert e.match(match)


def test_odcfn_train_with_a_lora_section(tmp_path):
    """``[lora]`` in run.toml: an HF base, adapter-only checkpoints that reference it, a resume
    that continues exactly, and a merged export."""
    from odcfn import cli
    from odcfn.checkpoint.sharded import read_manifest
    from odcfn.data.records import synthetic_records, write_jsonl
    from odcfn.models import from_hf, to_hf

    to_hf(tmp_path / "base", init_params(CFG, seed=3), CFG)
    write_jsonl(
        tmp_path / "train.jsonl", synthetic_records([5, 9, 7, 12, 6, 8, 10, 4], CFG.vocab_size, seed=0)
    )

    def setup(d):
        d.mkdir()
        (d / "run.toml").write_text(
            f'out_dir = "out"\n[model]\nhf_path = "{tmp_path / "base"}"\n'
            f'[data]\npath = "{tmp_path / "train.jsonl"}"\nbatch_size = 4\n'
            "[train]\nsteps = 4\nlr = 3e-2\nworld_size = 2\nmax_tokens_per_microbatch = 24\n"
            '[checkpoint]\nevery = 2\nexport_hf = "merged"\n'
            '[lora]\nrank = 2\nalpha = 4.0\ntargets = ["q_proj", "v_proj", "down_proj"]\n'
        )
        return str(d / "run.toml")

    a, b = setup(tmp_path / "a"), setup(tmp_path / "b")
    assert cli.main(["train", "--config", a, "--quiet"]) == 0
    assert cli.main(["train", "--config", b, "--quiet", "--steps", "2"]) == 0
    assert cli.main(["train", "--config", b, "--quiet"]) == 0  # resumes at step 2 on the same base
    doc = read_manifest(tmp_path / "a" / "out" / "checkpoints" / "step-00000004")
    assert set(doc["units"]) == {"lora.layers.0", "lora.layers.1"}
    assert doc["extra"]["frozen_base"]["path"] == str((tmp_path / "base").resolve())
    la = [json.loads(x)["loss"] for x in (tmp_path / "a" / "out" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "b" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert la == lb and la[-1] < la[0]
    merged_a, merged_b = (
        from_hf(tmp_path / "a" / "merged")[1],
        from_hf(tmp_path / "b" / "merged")[1],
    )
    assert odcfn.tree_allclose(merged_a, merged_b, rtol=0, atol=0)
    base = from_hf(tmp_path / "base")[1]
    assert not torch.equal(
        merged_a["layers.0"]["self_attn"]["q_proj"]["weight"],
        base["layers.0"]["self_attn"]["q_proj"]["weight"],
    )
    assert torch.equal(
        merged_a["layers.0"]["self_attn"]["k_proj"]["weight"],
        base["layers.0"]["self_attn"]["k_proj"]["weight"],
    )


@pytest.mark.parametrize("comm", ["odc", "collective"])
def test_log_probs_and_remat_of_a_lora_state_equal_the_merged_base(comm):
    from odcfn.schedule.plan import ScheduleOptions

    model, params = _lora(seed=3, targets=("q_proj", "down_proj"))
    base, merged = lora.base_model(model), lora.merge(model, params)
    batch = odcfn.random_batch([5, 7, 3, 9, 4], CFG.vocab_size, seed=3)
    remat = ScheduleOptions(remat={"layers.0", "lora.layers.1"})

    def fn(r, t):
        st = odcfn.TrainState.create(
            params=params,
            model=model,
            optimizer=odcfn.sgd(0.0),
            transport=t,
            config=odcfn.StepConfig(comm=comm, options=remat),
        )
        return odcfn.log_probs(st, batch), odcfn.grad_step(st, batch)[1].loss

    def fn_base(r, t):
        st = odcfn.TrainState.create(params=merged, model=base, optimizer=odcfn.sgd(0.0), transport=t)
        return odcfn.log_probs(st, batch)

    want = odcfn.run_local(fn_base, 1, timeout=60)[0]
    out = odcfn.run_local(fn, 3, timeout=60)
    for a, b in zip(out[1][0], want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert out[0][1] == pytest.approx(float(odcfn.reference_loss(base, merged, batch)), rel=1e-5)


def test_a_frozen_base_is_kept_in_the_compute_dtype_only():
    model, params = _lora(seed=4, targets=("q_proj", "up_proj"))
    config = odcfn.StepConfig(compute_dtype=torch.bfloat16, balance="lb_mini", max_tokens_per_microbatch=12)
    batches = [odcfn.random_batch([5, 7, 3, 9], CFG.vocab_size, seed=s) for s in range(2)]

    def fn(r, t):
        st = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.adamw(1e-2), transport=t,
                                     config=config)
        dtypes = {k: st.params[k].dtype for k in st.params}
        # the same shards kept in fp32: a frozen master the gathers round to bf16 anyway
        fp32 = odcfn.shard(params, model, t.mesh)
        ref = st.replace(params={**st.params, **{k: fp32[k] for k in model.frozen}})
        out = []
        for s in (st, ref):
            for b in batches:
                s, m = odcfn.train_step(s, b)
            out.append((m.loss, {k: s.params[k] for k in lora.adapter_units(model)}, odcfn.log_probs(s, b)))
        return dtypes, out

    for dtypes, ((loss, ad, lp), (loss_ref, ad_ref, lp_ref)) in odcfn.run_local(fn, 2, timeout=60):
        assert all(dtypes[k] == torch.bfloat16 for k in model.frozen)
        assert all(dtypes[k] == torch.float32 for k in lora.adapter_units(model))  # fp32 masters
        assert loss == loss_ref  # bit-identical: the gathers deliver the same bf16 values
        assert all(torch.equal(ad[k], ad_ref[k]) for k in ad) and any(ad[k].abs().sum() > 0 for k in ad)
        assert all(torch.equal(a, b) for a, b in zip(lp, lp_ref))


def test_the_base_is_hashed_once_per_process_while_its_files_are_unchanged(tmp_path):
    import hashlib
    import os

    from odcfn.checkpoint.frozen import base_reference

    model = _lora()[0]
    f = tmp_path / "base" / "model.safetensors"
    f.parent.mkdir()
    f.write_bytes(b"weights 1")
    first = base_reference(model, f.parent)["sha256"]["model.safetensors"]
    st = f.stat()
    f.write_bytes(b"weights 2")  # same size; the old mtime put back: the cached digest is reused
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert base_reference(model, f.parent)["sha256"]["model.safetensors"] == first
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # a new mtime: hashed again
    want = hashlib.sha256(b"weights 2").hexdigest()
    assert base_reference(model, f.parent)["sha256"]["model.safetensors"] == want
