"""Share rollouts across ranks: each rank generates and scores its share of the prompts, then two
sums over the transport give every rank every completion.

Every rank must hold the same minibatch (``train_step`` checks it), so the completions travel,
not the prompts: token ids, behaviour log-probs, rewards and, for a mixture of experts, the
routed experts. They are small next to the weights. Each rank writes its own slots of a zero
vector and the transport's ``sync`` sums them, which is an all-gather in all-reduce's clothes:
float64 sums of one value and zeros are exact, and token ids, expert ids and fp32 log-probs are
exactly representable in float64. The first sum carries the lengths (so every rank can size the
second), an agreement fingerprint of the prompts and config, and any error a rank hit while
generating or scoring, as UTF-8 bytes: every rank then raises the same message, before anyone
trains. Nothing received is unpickled or called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ERROR_BYTES", "Local", "Shared", "share", "share_range"]

ERROR_BYTES = 480  # room for one rank's error message per sum (longer ones are cut)
_HEAD = 5  # per completion: response length, stopped, reward, version, routed width


@dataclass(frozen=True)
class Local:
    """One completion as its generating rank holds it; ``index``: its global position."""

    index: int
    tokens: torch.Tensor  # (R,) int64
    logprobs: torch.Tensor  # (R,) fp32
    stopped: bool
    reward: float
    version: int
    routed: torch.Tensor | None = None  # (P + R, L, K) int


@dataclass(frozen=True)
class Shared:
    """One completion as every rank holds it after ``share``."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    stopped: bool
    reward: float
    version: int
    routed: torch.Tensor | None


def share_range(num_prompts: int, world_size: int, rank: int) -> range:
    """The prompts rank ``rank`` generates: contiguous, sizes differing by at most one."""
    per, extra = divmod(num_prompts, world_size)
    lo = rank * per + min(rank, extra)
    return range(lo, lo + per + (rank < extra))


def _encode_error(msg: str | None) -> torch.Tensor:
    out = torch.zeros(1 + ERROR_BYTES, dtype=torch.float64)
    if msg is not None:
        raw = msg.encode("utf-8", "replace")[:ERROR_BYTES]
        out[0] = 1.0
        out[1: 1 + len(raw)] = torch.tensor(list(raw), dtype=torch.float64)
    return out


def _decode_error(v: torch.Tensor) -> str | None:
    if round(float(v[0])) == 0:
        return None
    raw = bytes(int(round(float(b))) & 0xFF for b in v[1:])
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def share(
    sync, world_size: int, rank: int, total: int, mine: Sequence[Local], error: str | None,
    riders: torch.Tensor, prompt_lengths: Sequence[int], check_riders,
) -> list[Shared]:
    """Every completion, in global order, on every rank. ``sync``: the transport's sum.
    ``total``: the number of completions over all ranks; ``prompt_lengths[i]``: the prompt
    length of completion ``i`` (for the routed experts' rows). ``error``: this rank's error, if
    it failed before sharing (it still joins both sums, so no peer waits for it).
    ``riders``: agreement words (``odcfn.step.fingerprint.encode``) checked by
    ``check_riders(summed_riders)`` after the first sum, before any error is raised."""
    W = world_size
    head = torch.zeros(total, _HEAD, dtype=torch.float64)
    for c in mine:
        width = 0 if c.routed is None else c.routed[0].numel()
        head[c.index] = torch.tensor([c.tokens.numel(), float(c.stopped), c.reward, c.version, width],
                                     dtype=torch.float64)
    errors = torch.zeros(W, 1 + ERROR_BYTES, dtype=torch.float64)
    errors[rank] = _encode_error(error)
    summed = sync(torch.cat([head.reshape(-1), errors.reshape(-1), riders]))
    n_head = total * _HEAD
    check_riders(summed[n_head + errors.numel():])
    for r in range(W):
        msg = _decode_error(summed[n_head + r * (1 + ERROR_BYTES): n_head + (r + 1) * (1 + ERROR_BYTES)])
        if msg is not None:
            who = "this rank" if r == rank else f"rank {r}"
            raise ValueError(f"{msg} (raised on {who} while generating or scoring its share of the prompts)")
    head = summed[:n_head].view(total, _HEAD)
    lengths = [round(float(x)) for x in head[:, 0]]
    widths = [round(float(x)) for x in head[:, 4]]
    offsets, at = [], 0
    for i in range(total):  # tokens, logprobs, then (prompt + response) rows of routed experts
        offsets.append(at)
        at += 2 * lengths[i] + (prompt_lengths[i] + lengths[i]) * widths[i]
    body = torch.zeros(at, dtype=torch.float64)
    for c in mine:
        o, n = offsets[c.index], lengths[c.index]
        body[o: o + n] = c.tokens.double()
        body[o + n: o + 2 * n] = c.logprobs.double()
        if c.routed is not None:
            body[o + 2 * n: o + 2 * n + c.routed.numel()] = c.routed.reshape(-1).double()
    body = sync(body)
    out = []
    for i in range(total):
        o, n, w = offsets[i], lengths[i], widths[i]
        routed = None
        if w:
            rows = prompt_lengths[i] + n
            routed = body[o + 2 * n: o + 2 * n + rows * w].round().long().view(rows, w)
        out.append(Shared(
            tokens=body[o: o + n].round().long(), logprobs=body[o + n: o + 2 * n].float(),
            stopped=bool(round(float(head[i, 1]))), reward=float(head[i, 2]),
            version=round(float(head[i, 3])), routed=routed,
        ))
    return out
