"""Sampling with vLLM's semantics, each sequence on its own random stream.

A sequence's randomness is one uniform number per generated token, drawn from its own
``torch.Generator`` seeded from ``(seed, prompt position in the call, index in the group)``
(``Uniforms``: drawn ``CHUNK`` at a time, one torch call per chunk rather than per token);
the token is the inverse CDF of the allowed, renormalised distribution at that number. So a
completion depends on its seed and its own logits only, never on which other sequences shared
its batch (``max_batch_tokens``) or on the device: the uniforms are drawn on the CPU and the
same seeds give the same tokens on CPU and CUDA up to the logits' own rounding.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

__all__ = ["Uniforms", "allowed", "sample", "sample_logprobs", "sequence_generator", "token_logprobs"]


def sequence_generator(seed: int, prompt_index: int, index: int) -> torch.Generator:
    """The random stream of completion ``index`` of prompt ``prompt_index`` under ``seed``: a hash
    of the three (not ``seed + i``, so that neighbouring seeds share no streams)."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def fresh_seed() -> int:
    """A seed from the OS's entropy (``SamplingParams.seed=None``), never from torch's global RNG."""
    return secrets.randbits(62)


class Uniforms:
    """One sequence's stream of float64 uniforms in [0, 1), taken one per generated token: a
    function of its generator alone (chunks of a fixed size), so of the seed, never of the batch."""

    CHUNK = 64

    def __init__(self, gen: torch.Generator) -> None:
        self.gen, self.buf, self.at = gen, [], 0

    def next(self) -> float:
        if self.at == len(self.buf):
            self.buf, self.at = torch.rand(self.CHUNK, generator=self.gen, dtype=torch.float64).tolist(), 0
        self.at += 1
        return self.buf[self.at - 1]


def allowed(z_BxV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens top-k then top-p keep (bool ``BxV``), as vLLM's sampler does: top-k keeps every
    logit >= the k-th largest (ties at the boundary stay); top-p keeps, of what top-k left, the
    most likely tokens until their renormalised mass reaches ``top_p`` (a token stays when the
    mass strictly above it is < ``top_p``; the most likely always stays). ``z``: logits after
    temperature."""
    V = z_BxV.shape[-1]
    if (not top_k or top_k >= V) and top_p >= 1.0:
        return torch.ones_like(z_BxV, dtype=torch.bool)
    srt_BxV, order_BxV = z_BxV.sort(dim=-1, descending=True)
    keep_BxV = torch.ones_like(srt_BxV, dtype=torch.bool)
    if top_k and top_k < V:
        keep_BxV = srt_BxV >= srt_BxV[:, top_k - 1: top_k]
    if top_p < 1.0:
        p_BxV = torch.softmax(srt_BxV.double().masked_fill(~keep_BxV, -torch.inf), dim=-1)
        above_BxV = p_BxV.cumsum(-1) - p_BxV
        keep_BxV = keep_BxV & (above_BxV < top_p)
        keep_BxV[:, 0] = True
    return torch.zeros_like(keep_BxV).scatter(-1, order_BxV, keep_BxV)


def sample(z_BxV: torch.Tensor, u_B: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Token ids drawn from ``softmax(z)`` restricted to ``allowed`` and renormalised: the
    inverse CDF at ``u`` (vocabulary order). The masses are fp32 (relative error ~1e-7 each),
    their running sum float64 (no drift over a 150K vocabulary), unnormalised (the target is
    ``u`` times the total). A disallowed token has zero mass, so its CDF step is empty and no
    ``u`` lands on it."""
    return sample_logprobs(z_BxV, u_B, top_k, top_p)[0]


def sample_logprobs(
    z_BxV: torch.Tensor, u_B: torch.Tensor, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` and the fp32 log-prob of each drawn token under the unrestricted
    ``softmax(z)`` (``token_logprobs``), from one pass of ``exp`` over the vocabulary: the
    sampling masses and the log-softmax's normaliser share it."""
    z = z_BxV.float()
    m_Bx1 = z.amax(-1, keepdim=True)
    e_BxV = torch.exp(z - m_Bx1)
    lse_B = m_Bx1[:, 0] + e_BxV.sum(-1).log()  # log-softmax = z - max - log(sum(exp(z - max)))
    if top_k or top_p < 1.0:
        e_BxV = e_BxV * allowed(z_BxV, top_k, top_p)
    cdf_BxV = e_BxV.double().cumsum(-1)
    total_B = cdf_BxV[:, -1]
    # kept below the total: u * total rounding up to it would step past the last token with mass
    target_B = torch.minimum(u_B.double() * total_B, torch.nextafter(total_B, torch.zeros_like(total_B)))
    tok_B = torch.searchsorted(cdf_BxV, target_B[:, None], right=True)[:, 0]
    return tok_B, z.gather(-1, tok_B[:, None])[:, 0] - lse_B


def token_logprobs(z_BxV: torch.Tensor, tok_B: torch.Tensor) -> torch.Tensor:
    """fp32 log-prob of each token under ``softmax(z)`` (``z``: fp32 logits after temperature,
    before top-k/top-p: what ``odcfn.log_probs(..., temperature=T)`` computes)."""
    return torch.log_softmax(z_BxV.float(), dim=-1).gather(-1, tok_B[:, None])[:, 0]
