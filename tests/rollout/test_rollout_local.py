"""``odcfn.rollout.LocalEngine`` in one process: the KV cache equals recomputation, greedy
decoding equals transformers' ``generate``, sampling follows the softmax at the temperature
(chi-square), top-k/top-p stay in their set, seeds do not depend on batching, bad input."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.rollout import LocalEngine, SamplingParams
from odcfn.rollout import decode as dec
from odcfn.rollout.sample import allowed, sample
from tests.rollout.rollout_util import CONFIGS, DENSE, MOE, full_logits, prompts, qwen_model, sharp_params


def _engine(cfg, seed=0, **kw) -> tuple[LocalEngine, dict]:
    params = sharp_params(cfg, seed)
    return LocalEngine(qwen_model(cfg), cfg, params=params, **kw), params


# --- the KV cache ----------------------------------------------------------------------------


@pytest.mark.parametrize("lens", [(5, 2), (4, 4)], ids=["ragged", "even"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_kv_cache_steps_equal_a_full_forward_of_the_prefix(name, lens):
    """Prefill two prompts into one batch, then decode token by token: every step's logits equal
    the logits of a full forward of that row's prefix. Prompts of equal length decode without
    an attention mask (``masked=False``, as the engine does when every row is at one position)."""
    cfg = CONFIGS[name]
    params = sharp_params(cfg, 1)
    w = dec.make_weights(cfg, params, None)
    ps = prompts(cfg.vocab_size, list(lens), seed=1)
    cache = dec.KVCache(cfg, torch.float32, torch.device("cpu"))
    cache.rebuild([], 0, 2, 14)
    h, _ = dec.prefill(w, cache, [0, 1], torch.tensor(ps[0] + ps[1]), list(lens))
    seqs = [list(p) for p in ps]
    z = dec.logits(w, h)
    for _ in range(8):
        for b, s in enumerate(seqs):
            want = full_logits(cfg, params, s)[-1]
            torch.testing.assert_close(z[b], want, rtol=0, atol=2e-5)
        nxt = z.argmax(-1)
        pos = torch.tensor([len(s) for s in seqs])
        for s, t in zip(seqs, nxt.tolist()):
            s.append(t)
        h, _ = dec.decode(w, cache, nxt, pos, int(pos.max()) + 1, masked=lens[0] != lens[1])
        z = dec.logits(w, h)


@pytest.mark.parametrize("name", ["qwen3", "moe2"])
def test_reported_logprobs_equal_recomputation_while_rows_join_and_leave(name):
    """A small budget makes sequences wait, join and leave the batch (the cache is rebuilt);
    each reported log-prob equals the full forward's at its position."""
    cfg = CONFIGS[name]
    eng, params = _engine(cfg, 2, max_batch_tokens=24)
    ps = prompts(cfg.vocab_size, [3, 7, 2, 5], seed=2)
    sp = SamplingParams(max_tokens=9, temperature=0.8, n=2, seed=5, stop_token_ids=tuple(range(0, 40, 8)))
    outs = eng.generate(ps, sp)
    assert {c.finish_reason for c in outs} == {"stop", "length"}  # both ways of leaving happen
    for c in outs:
        p = ps[c.prompt_index]
        z = full_logits(cfg, params, p + c.tokens.tolist()) / 0.8
        want = torch.log_softmax(z, -1)[len(p) - 1: -1].gather(-1, c.tokens[:, None])[:, 0]
        torch.testing.assert_close(c.logprobs, want, rtol=0, atol=2e-5)


# --- greedy against transformers --------------------------------------------------------------


def _hf_from(tmp_path, cfg, params):
    import transformers

    odcfn.models.to_hf(tmp_path / "hf", params, cfg)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()


@pytest.mark.parametrize("name", ["dense", "qwen3", "llama", "moe", "moe2"])
def test_greedy_equals_transformers_generate(tmp_path, name):
    cfg = CONFIGS[name]
    eng, params = _engine(cfg, 3, max_batch_tokens=20)
    ref = _hf_from(tmp_path, cfg, params)
    ps = prompts(cfg.vocab_size, [4, 9, 1, 6], seed=3)
    outs = eng.generate(ps, SamplingParams(max_tokens=10, temperature=0.0))
    for p, c in zip(ps, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
        assert c.tokens.tolist() == want[0, len(p):].tolist()
        assert c.finish_reason == "length"


# --- the sampling distribution ------------------------------------------------------------------


def _chi_square_p(counts, probs) -> float:
    """Pearson's chi-square p-value (bins with expected count < 5 merged into one)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_b = torch.cat([counts[big], counts[~big].sum()[None]]) if (~big).any() else counts[big]
    exp_b = torch.cat([exp[big], exp[~big].sum()[None]]) if (~big).any() else exp[big]
    keep = exp_b > 0
    obs_b, exp_b = obs_b[keep], exp_b[keep]
    stat = ((obs_b - exp_b) ** 2 / exp_b).sum()
    df = obs_b.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _restricted(z, top_k, top_p):
    keep = allowed(z[None], top_k, top_p)[0]
    p = torch.softmax(z.double(), -1) * keep
    return p / p.sum(), keep


@pytest.mark.parametrize("T,top_k,top_p", [(0.7, 0, 1.0), (0.8, 6, 1.0), (1.0, 0, 0.8), (0.6, 9, 0.85)])
def test_first_token_distribution_is_the_softmax_at_temperature(T, top_k, top_p):
    """N = 6000 first tokens (each completion its own stream) against the renormalised allowed
    softmax at T; reject at p < 1e-3 (false alarm 0.1%). Power: against sampling at 1.25 T
    (a temperature handled wrongly by 25%) inside the same allowed set, the same test on the
    same N rejects in >= 99% of 400 simulated runs (measured 99.5-100%), asserted below for each
    case; a token outside the allowed set is a failure by itself."""
    cfg, N = DENSE, 6000
    eng, params = _engine(cfg, 4)
    p0 = prompts(cfg.vocab_size, [5], seed=4)[0]
    sp = SamplingParams(max_tokens=1, temperature=T, top_k=top_k, top_p=top_p, n=N, seed=11)
    outs = eng.generate([p0], sp)
    first = torch.tensor([c.tokens[0] for c in outs])
    V = cfg.vocab_size
    counts = torch.bincount(first, minlength=V).double()
    z = full_logits(cfg, params, p0)[-1]
    want, keep = _restricted(z / T, top_k, top_p)
    assert counts[~keep].sum() == 0
    assert _chi_square_p(counts, want) > 1e-3
    alt, _ = _restricted(z / (1.25 * T), top_k, top_p)
    g = torch.Generator().manual_seed(0)
    sims = torch.multinomial(alt.float(), N * 400, replacement=True, generator=g).view(400, N)
    rejected = [_chi_square_p(torch.bincount(s, minlength=V).double(), want) < 1e-3 for s in sims]
    assert sum(rejected) >= 0.99 * 400


def test_top_k_top_p_never_leave_the_allowed_set():
    # the sampler alone, on random logits and every edge of u
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 50, generator=g) * 3
    z[:4, :10] = 20.0  # ten tied top logits: at the top-k boundary for k <= 10
    for top_k, top_p in [(1, 1.0), (5, 1.0), (0, 0.3), (7, 0.9), (50, 0.05)]:
        keep = allowed(z, top_k, top_p)
        # vLLM's definition: sorted ascending, drop tokens whose cumulative mass <= 1 - top_p
        if top_k and top_p == 1:  # ties at the k-th logit stay (rows 0-3 keep all ten)
            assert (keep.sum(-1) >= top_k).all() and (keep[:4].sum(-1) >= 10).all()
        edges = [torch.zeros(64), torch.full((64,), 1 - 2**-53)]
        for u in [*edges, torch.rand(64, generator=g, dtype=torch.float64)]:
            tok = sample(z, u, top_k, top_p)
            assert keep.gather(-1, tok[:, None]).all()
        if top_p < 1:
            srt, _ = torch.softmax((z.double()).masked_fill(~allowed(z, top_k, 1.0), -torch.inf), -1).sort(-1)
            vllm_kept = (srt.cumsum(-1) > 1 - top_p).sum(-1)
            vllm_kept = torch.maximum(vllm_kept, torch.ones_like(vllm_kept))
            assert torch.equal(keep.sum(-1), vllm_kept)
    # the engine, many tokens deep: each token lies in the set its own logits allow
    cfg = DENSE
    eng, params = _engine(cfg, 5)
    ps = prompts(cfg.vocab_size, [3, 6], seed=5)
    for top_k, top_p in [(3, 1.0), (0, 0.5), (4, 0.7)]:
        sp = SamplingParams(max_tokens=12, temperature=1.5, top_k=top_k, top_p=top_p, n=8, seed=1)
        outs = eng.generate(ps, sp)
        for c in outs:
            p = ps[c.prompt_index]
            z = full_logits(cfg, params, p + c.tokens.tolist())[len(p) - 1: -1] / 1.5
            assert allowed(z, top_k, top_p).gather(-1, c.tokens[:, None]).all()


# --- seeds, finishing, grouping -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_seeded_results_do_not_depend_on_the_batch_budget(name):
    cfg = CONFIGS[name]
    params = sharp_params(cfg, 6)
    ps = prompts(cfg.vocab_size, [4, 8, 2, 5, 3], seed=6)
    sp = SamplingParams(max_tokens=7, temperature=1.0, top_p=0.9, n=3, seed=21, stop_token_ids=(2,))
    runs = [LocalEngine(qwen_model(cfg), cfg, params=params, max_batch_tokens=b).generate(ps, sp)
            for b in (1, 13, 40, 10_000)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.tokens.tolist() == b.tokens.tolist() and a.finish_reason == b.finish_reason
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
            if name == "moe":
                assert torch.equal(a.routed_experts, b.routed_experts)
    # a completion is a function of (seed, prompt position, index in the group) only
    eng = LocalEngine(qwen_model(cfg), cfg, params=params)
    assert [c.tokens.tolist() for c in eng.generate(ps[:2], sp)] == [c.tokens.tolist() for c in runs[0][:6]]
    other = eng.generate(ps, SamplingParams(max_tokens=7, n=3, seed=22, top_p=0.9, stop_token_ids=(2,)))
    assert [c.tokens.tolist() for c in other] != [c.tokens.tolist() for c in runs[0]]
    unseeded = [eng.generate(ps, SamplingParams(max_tokens=7, n=3)) for _ in range(2)]
    assert [c.tokens.tolist() for c in unseeded[0]] != [c.tokens.tolist() for c in unseeded[1]]


def test_finish_reasons_lengths_grouping_and_routing_shape():
    cfg = MOE
    eng, _ = _engine(cfg, 7, max_model_len=10)
    ps = prompts(cfg.vocab_size, [3, 6, 9], seed=7)
    outs = eng.generate(ps, SamplingParams(max_tokens=5, temperature=0.0, n=2))
    assert [c.prompt_index for c in outs] == [0, 0, 1, 1, 2, 2]
    assert [c.length for c in outs] == [5, 5, 4, 4, 1, 1]  # max_tokens, then max_model_len - prompt
    assert all(c.finish_reason == "length" and c.version == 0 for c in outs)
    assert outs[0].tokens.tolist() == outs[1].tokens.tolist()  # greedy: the group agrees
    for c in outs:
        r = c.routed_experts
        n = len(ps[c.prompt_index]) + c.length
        assert r.shape == (n, 2, cfg.num_experts_per_tok) and not r.dtype.is_floating_point
        assert torch.equal(r[-1], r[-2])
    stop = outs[0].tokens[2].item()
    c = eng.generate([ps[0]], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(stop, 999)))[0]
    first = outs[0].tokens.tolist().index(stop)
    assert c.tokens.tolist() == outs[0].tokens.tolist()[: first + 1] and c.finish_reason == "stop"
    torch.testing.assert_close(c.logprobs, outs[0].logprobs[: first + 1], rtol=0, atol=1e-5)


def test_lora_params_are_merged_and_bf16_runs():
    cfg = DENSE
    params = sharp_params(cfg, 8)
    lm, lp = odcfn.lora.apply(qwen_model(cfg), params, rank=2, alpha=4, targets=("q_proj", "down_proj"))
    lp = odcfn.tree_map(lambda t: t, lp)
    lp["lora.layers.0"]["self_attn"]["q_proj"]["lora_B"] = torch.randn(24, 2)  # a trained adapter
    ps = prompts(cfg.vocab_size, [4, 7], seed=8)
    sp = SamplingParams(max_tokens=6, seed=3)
    got = LocalEngine(lm, cfg, params=lp).generate(ps, sp)
    merged = LocalEngine(qwen_model(cfg), cfg, params=odcfn.lora.merge(lm, lp)).generate(ps, sp)
    base = LocalEngine(qwen_model(cfg), cfg, params=params).generate(ps, sp)
    assert [c.tokens.tolist() for c in got] == [c.tokens.tolist() for c in merged]
    assert not all(torch.allclose(a.logprobs, b.logprobs) for a, b in zip(got, base))
    seqs = [p + c.tokens.tolist() for p, c in zip(ps, base)]
    half = LocalEngine(qwen_model(cfg), cfg, params=params, dtype=torch.bfloat16).score(seqs)
    full = LocalEngine(qwen_model(cfg), cfg, params=params).score(seqs)
    for h, f in zip(half, full):
        assert h.dtype == torch.float32 and float((h - f).abs().max()) < 0.25  # bf16's own error


# --- bad input ------------------------------------------------------------------------------------


def test_bad_input_gets_clear_errors():
    cfg = DENSE
    sp = SamplingParams(max_tokens=3)
    empty = LocalEngine(qwen_model(cfg), cfg, max_model_len=8)
    with pytest.raises(RuntimeError, match="no weights"):
        empty.generate([[1, 2]], sp)
    eng, params = _engine(cfg, 9, max_model_len=8)
    for bad, err, match in [
        ([[1, 2], []], ValueError, "prompt 1 is empty"),
        ([list(range(8))], ValueError, "prompt 0 has 8 tokens.*maximum length is 8"),
        ([[1, cfg.vocab_size]], ValueError, "token id 40 is outside the vocabulary"),
        ([[-1]], ValueError, "token id -1"),
        (["hello"], TypeError, "prompt 0 must be a list of token ids"),
        ([[1.5]], TypeError, "prompt 0"),
        (torch.tensor([[1, 2]]), TypeError, "prompts must be a list"),
    ]:
        with pytest.raises(err, match=match):
            eng.generate(bad, sp)
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.generate([[1]], {"max_tokens": 3})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_tokens=3, top_p=1.5)
    wrong = dict(params, head={"norm": params["head"]["norm"]})  # the head lacks lm_head
    with pytest.raises(ValueError, match="head"):
        LocalEngine(qwen_model(cfg), cfg, params=wrong)
    with pytest.raises(ValueError, match="another config"):
        LocalEngine(qwen_model(cfg), MOE)
    with pytest.raises(TypeError, match="odcfn.Model"):
        LocalEngine(cfg, cfg)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        LocalEngine(qwen_model(cfg), cfg, max_batch_tokens=0)
    with pytest.raises(TypeError, match="TrainState"):
        eng.update_weights(params)
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate([[1]], sp)
