"""``odcfn.rl.advantages`` against two independent re-derivations of verl's estimators
(verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py ``masked_whiten``):

1. ``ref_scalars``: plain Python floats, one sample at a time, with ``statistics`` doing the
   unbiased variance of the whitened estimators over a list holding each sample's value once
   per response token;
2. ``ref_verl_tokens``: verl's data layout, written out here: right-padded (batch, response
   length) token-level rewards holding the score on each response's last token, a response
   mask, groups found through an index array, returns summed back to front, and whitening over
   the masked tokens. Its per-token output is compared with ``token_advantages``' rows.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import odcfn
from odcfn.rl import ESTIMATORS, advantages, token_advantages

NO_BASELINE = "reinforce_plus_plus_no_baseline"

EPS = 1e-6


def ref_scalars(rewards, n, estimator, *, norm=True, lengths=None):
    """verl's formulas, sample by sample, in Python floats."""
    lengths = lengths or [1] * len(rewards)
    base = []
    for g in range(len(rewards) // n):
        grp = rewards[g * n:(g + 1) * n]
        for x in grp:
            if n == 1:  # verl: a lone sample's group has mean 0 and std 1
                mean, std, others = 0.0, 1.0, None
            else:
                mean = sum(grp) / n
                std = math.sqrt(sum((y - mean) ** 2 for y in grp) / (n - 1))
                others = (sum(grp) - x) / (n - 1)
            if estimator == "grpo":
                base.append((x - mean) / (std + EPS) if norm else x - mean)
            elif estimator == "rloo":
                base.append(x if others is None else x - others)  # leave-one-out baseline
            elif estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
                base.append(x - mean)
            else:
                base.append(x)
    if estimator in ("grpo", "rloo"):
        return base
    tokens = [v for v, k in zip(base, lengths) for _ in range(k)]
    mu, var = statistics.fmean(tokens), statistics.variance(tokens)  # variance: divides by N - 1
    return [(v - mu) / math.sqrt(var + 1e-8) for v in base]


def ref_verl_tokens(rewards, n, estimator, lengths, *, norm=True):
    """verl's layout and steps: (B, T) tensors, per-token advantages (0 on padding)."""
    B, T = len(rewards), max(lengths)
    mask = torch.zeros(B, T, dtype=torch.float64)
    token_rewards = torch.zeros(B, T, dtype=torch.float64)
    for i, (r, k) in enumerate(zip(rewards, lengths)):
        mask[i, :k] = 1
        token_rewards[i, k - 1] = r  # the outcome reward sits on the last response token
    index = [f"uid{i // n}" for i in range(B)]
    scores = token_rewards.sum(-1)

    def whiten(values):
        # verl's masked_mean divides by (count + 1e-8): in float32, verl's dtype, that is the
        # count itself for any count >= 1, so the float64 reference leaves the 1e-8 out
        cnt = mask.sum()
        mean = (values * mask).sum() / cnt
        var = (((values - mean) ** 2) * mask).sum() / cnt * cnt / (cnt - 1)
        return (values - mean) / torch.sqrt(var + 1e-8)

    if estimator == "reinforce_plus_plus_no_baseline":
        returns = torch.zeros_like(token_rewards)
        running = torch.zeros(B, dtype=torch.float64)
        for t in reversed(range(T)):  # gamma = 1, reset past each response's end
            running = token_rewards[:, t] + running
            returns[:, t] = running
            running = running * mask[:, t]
        return whiten(returns) * mask
    by_uid = defaultdict(list)
    for i in range(B):
        by_uid[index[i]].append(scores[i])
    out = torch.zeros(B, dtype=torch.float64)
    for i in range(B):
        grp = torch.stack(by_uid[index[i]])
        m = len(grp)
        mean = grp.mean() if m > 1 else torch.tensor(0.0, dtype=torch.float64)
        std = grp.std() if m > 1 else torch.tensor(1.0, dtype=torch.float64)
        if estimator == "grpo":
            out[i] = (scores[i] - mean) / (std + EPS) if norm else scores[i] - mean
        elif estimator == "rloo":
            out[i] = (scores[i] - mean) * m / (m - 1) if m > 1 else scores[i]
        else:
            out[i] = scores[i] - mean
    tokens = out[:, None].expand(B, T) * mask
    baseline_then_whiten = estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
    return whiten(tokens) * mask if baseline_then_whiten else tokens


def _close(got, want, tol=2e-5):
    want = torch.as_tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


CASES = [
    ([1.0, 0.0, 0.0, 1.0], 2),
    ([1.0, 1.0, 1.0, 0.0, 0.5, 0.25], 3),
    ([0.0, 0.0, 0.0, 0.0, 2.0, -1.0, 3.5, 0.0], 4),
]


@pytest.mark.parametrize("rewards,n", CASES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_each_estimator_equals_both_references(rewards, n, estimator):
    lengths = [3 + (7 * i) % 5 for i in range(len(rewards))]
    lens = lengths if estimator.startswith("reinforce") else None
    got = advantages(torch.tensor(rewards), n, estimator, response_lengths=lens)
    assert got.dtype == torch.float32 and got.shape == (len(rewards),)
    _close(got, ref_scalars(rewards, n, estimator, lengths=lens))
    rows = token_advantages(got, [2] * len(rewards), lengths)
    tokens = ref_verl_tokens(rewards, n, estimator, lengths)
    for i, row in enumerate(rows):
        _close(row[2:], tokens[i, : lengths[i]])


def test_grpo_by_hand_and_dr_grpo():
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5); Dr. GRPO keeps r - mean
    s = math.sqrt(0.5)
    _close(advantages([1.0, 0.0], 2), [0.5 / (s + EPS), -0.5 / (s + EPS)])
    _close(advantages([1.0, 0.0], 2, norm_adv_by_std_in_grpo=False), [0.5, -0.5])
    # a group with one reward throughout has no signal: 0, not 0/0
    for est in ESTIMATORS:
        assert advantages([0.7, 0.7, 0.7], 3, est).tolist() == [0.0, 0.0, 0.0], est
    # rloo of [1, 0, 0]: 1 - 0 = 1 and 0 - (1 + 0) / 2
    _close(advantages([1.0, 0.0, 0.0], 3, "rloo"), [1.0, -0.5, -0.5])


def test_whitening_weighs_samples_by_response_length():
    r = [1.0, 0.0, 0.0, 0.0]
    plain = advantages(r, 2, "reinforce_plus_plus_baseline")
    weighted = advantages(r, 2, "reinforce_plus_plus_baseline", response_lengths=[10, 1, 1, 1])
    assert not torch.allclose(plain, weighted)
    _close(weighted, ref_scalars(r, 2, "reinforce_plus_plus_baseline", lengths=[10, 1, 1, 1]))
    # reinforce_plus_plus is the group-baseline form (verl's reinforce_plus_plus_baseline)
    _close(advantages(r, 2, "reinforce_plus_plus", response_lengths=[10, 1, 1, 1]), weighted)
    # reinforce_plus_plus_no_baseline (verl's reinforce_plus_plus): the raw rewards, whitened
    r = [1.0, 0.0, 3.0]
    _close(advantages(r, 1, "reinforce_plus_plus_no_baseline"),
           ref_scalars(r, 1, "reinforce_plus_plus_no_baseline"))


def test_a_group_of_one_is_refused_unless_asked_then_follows_verl():
    for est in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match=r"group_size \(the engine's n\) must be >= 2, got 1"):
            advantages([1.0, 0.0], 1, est)
    _close(advantages([2.0, -1.0], 1, allow_group_of_one=True), [2.0 / (1 + EPS), -1.0 / (1 + EPS)])
    _close(advantages([2.0, -1.0], 1, "rloo", allow_group_of_one=True), [2.0, -1.0])
    _close(
        advantages([2.0, -1.0, 0.5], 1, "reinforce_plus_plus_baseline", allow_group_of_one=True),
        advantages([2.0, -1.0, 0.5], 1, "reinforce_plus_plus_no_baseline"),
    )


@pytest.mark.parametrize(
    "kwargs,err,msg",
    [
        (dict(rewards=[1.0, 0.0], group_size=2, estimator="ppo"), ValueError,
         "unknown advantage estimator 'ppo': known ones are grpo, rloo, reinforce_plus_plus, "
         "reinforce_plus_plus_baseline, reinforce_plus_plus_no_baseline"),
        (dict(rewards=[1.0, 0.0, 1.0], group_size=2), ValueError,
         r"3 rewards do not divide into groups of group_size=2 \(1 full groups and 1 left over\)"),
        (dict(rewards=[1.0, float("nan"), 0.0, 1.0], group_size=2), ValueError,
         r"rewards\[1\] is nan \(sample 1 of group 0\): rewards must be finite"),
        (dict(rewards=[1.0, 0.0, float("inf"), 1.0], group_size=2), ValueError,
         r"rewards\[2\] is inf \(sample 0 of group 1\)"),
        (dict(rewards=[], group_size=2), ValueError, "rewards is empty"),
        (dict(rewards=[1.0, 0.0], group_size=True), TypeError, "group_size must be an int >= 1, got bool"),
        (dict(rewards=[1.0, 0.0], group_size=0), ValueError, "group_size must be an int >= 1, got 0"),
        (dict(rewards=[1.0, "x"], group_size=2), TypeError, r"rewards\[1\] must be a real number"),
        (dict(rewards=torch.ones(2, 2), group_size=2), ValueError, r"rewards must be 1-D"),
        (dict(rewards=[1.0, 0.0], group_size=2, estimator=NO_BASELINE, response_lengths=[3]),
         ValueError, "response_lengths has 1 entries for 2 rewards"),
        (dict(rewards=[1.0, 0.0], group_size=2, estimator=NO_BASELINE, response_lengths=[3, 0]),
         ValueError, r"response_lengths\[1\] must be an int >= 1"),
        (dict(rewards=[1.0], group_size=1, estimator="reinforce_plus_plus_no_baseline"), ValueError,
         "whitening over the batch needs at least 2 response tokens"),
        (dict(rewards=[1.0, 0.0], group_size=2, norm_adv_by_std_in_grpo=1), TypeError,
         "norm_adv_by_std_in_grpo must be a bool"),
    ],
)
def test_bad_input_is_refused_by_name(kwargs, err, msg):
    with pytest.raises(err, match=msg):
        advantages(**kwargs)


def test_token_advantages_are_sample_extras():
    rows = token_advantages(torch.tensor([0.5, -2.0]), [3, 1], [2, 4])
    assert [r.tolist() for r in rows] == [[0, 0, 0, 0.5, 0.5], [0, -2, -2, -2, -2]]
    # aligned as a Sample's float extras: the response tokens are the loss tokens
    s = odcfn.Sample(torch.arange(5), loss_mask=torch.tensor([0, 0, 0, 1, 1]), extras={"advantages": rows[0]})
    mb = odcfn.batch.pack(odcfn.Batch((s,)), [0])
    assert mb.extras["advantages"][mb.loss_mask_T.bool()].tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="prompt_lengths has 1 entries for 2 advantages"):
        token_advantages([0.5, 1.0], [3], [2, 2])


groups = st.integers(2, 8).flatmap(
    lambda n: st.tuples(
        st.just(n),
        st.lists(
            st.one_of(
                st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n),  # ties, flat groups
                st.lists(st.floats(-10, 10, allow_nan=False, allow_subnormal=False), min_size=n, max_size=n),
            ),
            min_size=1, max_size=6,
        ),
    )
)


@given(groups, st.data())
def test_random_groups_equal_verl(case, data):
    n, gs = case
    rewards = [x for g in gs for x in g]
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=len(rewards), max_size=len(rewards)))
    norm = data.draw(st.booleans())
    for est in ESTIMATORS:
        lens = lengths if est.startswith("reinforce") else None
        got = advantages(rewards, n, est, norm_adv_by_std_in_grpo=norm, response_lengths=lens)
        want = ref_scalars(rewards, n, est, norm=norm, lengths=lens)
        # grpo divides by (std + 1e-6): a near-flat group magnifies float64 rounding, so compare
        # at float32's resolution relative to the largest advantage
        tol = 2e-5 * max(1.0, max(abs(w) for w in want))
        _close(got, want, tol)
        tokens = ref_verl_tokens(rewards, n, est, lengths, norm=norm)
        if est.startswith("reinforce"):  # the token rows equal verl's token-level result
            per_sample = [tokens[i, : lengths[i]] for i in range(len(rewards))]
            for i, row in enumerate(token_advantages(got, [1] * len(rewards), lengths)):
                _close(row[1:], per_sample[i], tol)
        # zero-sum within each group for the baseline estimators
        if est in ("grpo", "rloo"):
            for g in got.double().view(-1, n):
                assert abs(g.sum().item()) <= 1e-4 * max(1.0, g.abs().max().item())
