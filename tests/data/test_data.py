"""SFT data path: files -> samples with loss masks -> deterministic minibatches."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import odcfn
from odcfn.batch import pack
from odcfn.data.records import (
    TokenDataset,
    batch_at,
    iterate_batches,
    read_dataset,
    read_jsonl,
    steps_per_epoch,
    synthetic_records,
    write_jsonl,
)


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_masks_labels_and_defaults(tmp_path):
    f = _write_lines(
        tmp_path / "d.jsonl",
        [
            json.dumps({"input_ids": [1, 5, 9, 2], "loss_mask": [0, 0, 1, 1]}),
            "",  # blank lines are skipped
            json.dumps({"input_ids": [3, 7, 4], "labels": [-100, 7, 4]}),
            json.dumps({"input_ids": [8, 6]}),
        ],
    )
    ds = read_jsonl(f)
    assert ds.lengths == (4, 3, 2) and ds.num_tokens == 9
    assert ds.samples[0].loss_mask.tolist() == [False, False, True, True]
    assert ds.samples[1].loss_mask.tolist() == [False, True, True]
    assert ds.samples[2].loss_mask is None
    # loss tokens: mask[1:] sums -> 2, 2, and 1 (all but the first token)
    assert [s.num_loss_tokens for s in ds.samples] == [2, 2, 1]
    # the packed microbatch trains exactly on the masked-in targets
    mb = pack(odcfn.Batch(ds.samples), [0, 1])
    assert mb.labels_T.tolist() == [5, 9, 2, 0, 7, 4, 0]
    assert mb.loss_mask_T.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]


def test_masked_out_targets_do_not_change_the_loss(tmp_path):
    """The last token is only ever a label. Changing it changes the loss iff it is masked in."""
    from odcfn.models import QwenConfig, init_params, qwen_model

    cfg = QwenConfig(vocab_size=20, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8)
    model, params = qwen_model(cfg), init_params(cfg, seed=0)

    def loss(ids, mask):
        ds = read_jsonl(write_jsonl(tmp_path / "a.jsonl", [{"input_ids": ids, "loss_mask": mask}]))
        return float(odcfn.reference_loss(model, params, odcfn.Batch(ds.samples)))

    masked_out, masked_in = [0, 1, 1, 1, 0], [0, 1, 1, 1, 1]
    assert loss([1, 2, 3, 4, 5], masked_out) == loss([1, 2, 3, 4, 9], masked_out)
    assert loss([1, 2, 3, 4, 5], masked_in) != loss([1, 2, 3, 4, 9], masked_in)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", "d.jsonl:1: not valid JSON"),
        ('{"input_ids": []}', "non-empty list"),
        ('{"input_ids": [1, 2.5]}', "integers only"),
        ('{"input_ids": [1, 2, 99]}', r"span \[1, 99\], outside \[0, 50\)"),
        ('{"input_ids": [1, -2]}', "outside"),
        ('{"input_ids": [1, 2], "loss_mask": [1]}', "length 1, input_ids has 2"),
        ('{"input_ids": [1, 2], "loss_mask": [1, 2]}', "0/1"),
        ('{"input_ids": [1, 2], "loss_mask": [1, 1], "labels": [1, 2]}', "not both"),
        ('{"input_ids": [1, 2, 3, 4, 5, 6, 7]}', "7 tokens, more than max_length=6"),
        ("[1, 2]", "expected an object"),
    ],
)
def test_bad_lines_are_rejected_naming_file_and_line(tmp_path, line, match):
    f = _write_lines(tmp_path / "d.jsonl", [line])
    with pytest.raises(ValueError, match=match):
        read_jsonl(f, vocab_size=50, max_length=6)


def test_read_dataset_dispatch_and_empty(tmp_path):
    with pytest.raises(ValueError, match="unknown data format '.csv'"):
        read_dataset(tmp_path / "x.csv")
    f = _write_lines(tmp_path / "e.jsonl", [""])
    with pytest.raises(ValueError, match="no samples"):
        read_dataset(f)


def test_parquet_matches_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = synthetic_records([5, 9, 3], 30, seed=1)
    recs[1] = {"input_ids": recs[1]["input_ids"]}  # a row without a mask (null in parquet)
    table = pa.table(
        {
            "input_ids": [r["input_ids"] for r in recs],
            "loss_mask": [r.get("loss_mask") for r in recs],
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    a = read_dataset(tmp_path / "d.parquet", vocab_size=30)
    b = read_dataset(write_jsonl(tmp_path / "d.jsonl", recs), vocab_size=30)
    assert a.lengths == b.lengths == (5, 9, 3)
    for x, y in zip(a.samples, b.samples):
        assert torch.equal(x.tokens, y.tokens)
        assert (x.loss_mask is None) == (y.loss_mask is None)
        if x.loss_mask is not None:
            assert torch.equal(x.loss_mask, y.loss_mask)


def test_synthetic_records_are_sft_shaped():
    recs = synthetic_records([10, 4, 2], 17, prompt_fraction=0.3, seed=0)
    assert [len(r["input_ids"]) for r in recs] == [10, 4, 2]
    assert recs[0]["loss_mask"] == [0, 0, 0] + [1] * 7
    assert all(r["loss_mask"][-1] == 1 for r in recs)  # every sample has a target
    assert recs == synthetic_records([10, 4, 2], 17, prompt_fraction=0.3, seed=0)


def _ids(batch: odcfn.Batch, ds: TokenDataset) -> list[int]:
    index = {id(s): i for i, s in enumerate(ds.samples)}
    return [index[id(s)] for s in batch.samples]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 30), bs=st.integers(1, 8), seed=st.integers(0, 5), drop_last=st.booleans())
def test_each_epoch_is_a_permutation_and_batches_are_pure(n, bs, seed, drop_last):
    ds = TokenDataset(tuple(odcfn.Sample(torch.tensor([i, i + 1])) for i in range(n)))
    if drop_last and n < bs:
        with pytest.raises(ValueError, match="fewer than batch_size"):
            steps_per_epoch(ds, bs)
        return
    per = steps_per_epoch(ds, bs, drop_last=drop_last)
    for epoch in range(2):
        seen = []
        for i in range(per):
            b = batch_at(ds, epoch * per + i, bs, seed=seed, drop_last=drop_last)
            assert len(b) == bs or (not drop_last and i == per - 1)
            seen += _ids(b, ds)
        assert len(seen) == len(set(seen))  # no sample twice in an epoch
        assert len(seen) == (per * bs if drop_last else n)
    # resuming at any step gives the same batches as running through
    run = [_ids(b, ds) for _, b in iterate_batches(ds, bs, num_steps=2 * per, seed=seed, drop_last=drop_last)]
    resumed = [
        _ids(b, ds)
        for _, b in iterate_batches(ds, bs, start_step=per, num_steps=per, seed=seed, drop_last=drop_last)
    ]
    assert resumed == run[per:]


def test_shuffle_changes_with_epoch_and_seed():
    ds = TokenDataset(tuple(odcfn.Sample(torch.tensor([i, i])) for i in range(40)))
    e0 = _ids(batch_at(ds, 0, 40, seed=0), ds)
    assert e0 != _ids(batch_at(ds, 1, 40, seed=0), ds)
    assert e0 != _ids(batch_at(ds, 0, 40, seed=1), ds)
    assert _ids(batch_at(ds, 0, 40, shuffle=False), ds) == list(range(40))
    with pytest.raises(ValueError, match="step"):
        batch_at(ds, -1, 4)
    with pytest.raises(ValueError, match="batch_size"):
        batch_at(ds, 0, 0)


def test_minibatch_lengths_feed_the_balancer(tmp_path):
    recs = synthetic_records([12, 3, 7, 20, 5, 9], 30, seed=2)
    ds = read_jsonl(write_jsonl(tmp_path / "d.jsonl", recs))
    b = batch_at(ds, 0, 6, shuffle=False)
    assert b.lengths == (12, 3, 7, 20, 5, 9)
    assignment = odcfn.get_balancer("round_robin")(b.lengths, 2, 20)
    covered = sorted(i for rank in assignment for mb in rank for i in mb)
    assert covered == list(range(6))
