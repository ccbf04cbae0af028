"""What a restart hashes: each rank verifies the files it reads, once (choosing the snapshot and
then opening it), the ranks agree through one all-reduce, and a corrupt file one rank reads
makes every rank skip that snapshot alike. A LoRA save or load whose base records its own
digests (an odcfn checkpoint's manifest) hashes none of the base."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

import odcfn
from odcfn import lora
from odcfn.checkpoint import frozen, memory_tier, verify
from odcfn.checkpoint.memory_tier import MemoryTier
from odcfn.checkpoint.sharded import read_shards
from odcfn.models import QwenConfig, init_params, qwen_model

CFG = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)


@pytest.fixture
def hashes(monkeypatch):
    """(file path, thread) -> how many times it was hashed. The files in these tests were written
    just now; a restart reads files written before it, which ``matches`` keeps the digest of."""
    seen: Counter = Counter()
    real = verify.sha256

    def counted(path):
        seen[(path, threading.get_ident())] += 1
        return real(path)

    monkeypatch.setattr(verify, "sha256", counted)
    monkeypatch.setattr(frozen, "_hash_file", lambda p, real=frozen._hash_file: counted(p))
    monkeypatch.setattr(verify, "_SETTLED_NS", 0)
    verify._HASHED.clear()
    return seen


def _snapshots(tier: MemoryTier, steps, W: int = 2) -> None:
    model = qwen_model(CFG)

    def fn(rank, tr):
        state = odcfn.TrainState.create(params=init_params(CFG, seed=0), model=model,
                                        optimizer=odcfn.adamw(1e-2), transport=tr)
        for s in steps:
            odcfn.save(tier.path(s), state.replace(step=s))
        return True

    odcfn.run_local(fn, W)


def _restart(tmp_path, monkeypatch, W: int = 2):
    """Every rank: the tier's resume (a collective), then its shards read from the choice; the
    per-rank choice, thread, all-reduces and warnings (recorded per thread: the ranks are
    threads, and ``warnings.catch_warnings`` is process-wide)."""
    model = qwen_model(CFG)
    warned: dict[int, list[str]] = {}
    monkeypatch.setattr(memory_tier.warnings, "warn", lambda m, *a, **k: warned.setdefault(
        threading.get_ident(), []).append(str(m)))

    def fn(rank, tr):
        tier = MemoryTier(tmp_path / "run", mesh=tr.mesh, collectives=tr.collectives)
        before = tr.collectives.calls.get("all_reduce", 0)
        ck = tier.resume(tmp_path / "disk")
        reduces = tr.collectives.calls.get("all_reduce", 0) - before
        if ck is not None:
            read_shards(ck, model=model, mesh=tr.mesh)
        return ck, threading.get_ident(), reduces

    return [(ck, tid, n, warned.get(tid, [])) for ck, tid, n in odcfn.run_local(fn, W)]


def test_each_rank_hashes_the_files_it_reads_once_and_agrees_in_one_reduce(tmp_path, monkeypatch, hashes):
    monkeypatch.setenv("ODCFN_SHM_DIR", str(tmp_path / "shm"))
    tier = MemoryTier(tmp_path / "run")
    _snapshots(tier, [3, 4])
    hashes.clear()
    verify._HASHED.clear()
    outs = _restart(tmp_path, monkeypatch)
    for rank, (ck, tid, reduces, warned) in enumerate(outs):
        assert ck == tier.path(4) and reduces == 1 and not warned
        mine = {p.name: n for (p, t), n in hashes.items() if t == tid}
        assert mine == {verify.rank_file(rank): 1}, mine  # before: both files, and its own twice


def test_a_corrupt_file_one_rank_reads_is_skipped_by_every_rank(tmp_path, monkeypatch, hashes):
    monkeypatch.setenv("ODCFN_SHM_DIR", str(tmp_path / "shm"))
    tier = MemoryTier(tmp_path / "run")
    _snapshots(tier, [3, 4])
    f = tier.path(4) / verify.rank_file(1)
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    verify._HASHED.clear()
    outs = _restart(tmp_path, monkeypatch)
    assert [o[0] for o in outs] == [tier.path(3)] * 2  # every rank alike
    assert all(any("step-00000004" in m for m in o[3]) for o in outs)
    assert any("rank-00001.safetensors does not match" in m for m in outs[1][3])
    assert outs[0][2] == outs[1][2] == 2  # one round more for the one rejection


def test_alone_a_process_still_checks_every_file(tmp_path, monkeypatch, hashes):
    from odcfn.checkpoint.memory_tier import newest_verified

    monkeypatch.setenv("ODCFN_SHM_DIR", str(tmp_path / "shm"))
    tier = MemoryTier(tmp_path / "run")
    _snapshots(tier, [4])
    hashes.clear()
    verify._HASHED.clear()
    assert newest_verified([tier.root]) == tier.path(4)
    assert sorted(p.name for p, _ in hashes) == [verify.rank_file(0), verify.rank_file(1)]


def test_files_read_follow_the_new_mesh():
    doc = {"units": {"a": {"numel": 10, "shard_size": 5}, "b": {"numel": 3, "shard_size": 2}},
           "tree": {"type": "dict", "items": {}}}
    assert verify.files_read(doc, 0, 2) == {0} and verify.files_read(doc, 1, 2) == {1}
    assert verify.files_read(doc, 0, 1) == {0, 1}
    # 4 shards of ceil(10/4)=3: shard 1 reads a[3:6] (files 0, 1), b[1:2] (file 0)
    assert verify.files_read(doc, 1, 4) == {0, 1}
    assert verify.files_read(doc, 3, 4) == {0, 1}  # b's range is all padding: rank 0's file (dtype)


def test_lora_save_and_load_hash_no_base_file_whose_digest_the_base_records(tmp_path, hashes):
    base_params = init_params(CFG, seed=0)
    base_dir = tmp_path / "base"

    def save_base(rank, tr):
        st = odcfn.TrainState.create(params=base_params, model=qwen_model(CFG), optimizer=odcfn.sgd(0.0),
                                     transport=tr)
        odcfn.save(base_dir, st)
        return True

    odcfn.run_local(save_base, 2)
    frozen._DIGESTS.clear()
    hashes.clear()
    model, params = lora.apply(qwen_model(CFG), base_params, rank=2, alpha=4, targets=("q_proj",))

    def fn(rank, tr):
        st = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.adamw(1e-2), transport=tr)
        odcfn.save(tmp_path / "ck", st, base=base_dir)
        return odcfn.load(tmp_path / "ck", st).step

    assert odcfn.run_local(fn, 2) == [0, 0]
    base = [p.name for p, _ in hashes if p.parent == base_dir]
    assert base == ["manifest.json"] * len(base) and base, base  # the base's shards: never
    ref = odcfn.checkpoint.sharded.read_manifest(tmp_path / "ck")["extra"][frozen.KEY]
    want = {e["name"]: e["sha256"] for e in odcfn.checkpoint.sharded.read_manifest(base_dir)["files"]}
    assert {k: v for k, v in ref["sha256"].items() if k != "manifest.json"} == want
