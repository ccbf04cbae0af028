"""Balancers: sample lengths -> rank -> ordered microbatches (sample ids) under a token cap.

Every balancer is pure and deterministic: each rank computes the same assignment from the
lengths alone, so no communication is needed to agree on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from odcfn.schedule.plan import Assignment

__all__ = ["BALANCERS", "Balancer", "check_lengths", "get_balancer", "pack_greedy", "round_robin"]

Balancer = Callable[[Sequence[int], int, int], Assignment]


def check_lengths(lengths: Sequence[int], max_tokens: int) -> None:
    """Every sample must fit in one microbatch: raise naming the first one that does not."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch must be a positive int, got {max_tokens!r}")
    if len(lengths) == 0:
        raise ValueError("cannot balance an empty minibatch")
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(
                f"sample {i} has {n} tokens, more than max_tokens_per_microbatch={max_tokens}"
            )


def pack_greedy(sample_ids: Sequence[int], lengths: Sequence[int], max_tokens: int) -> tuple[tuple[int, ...], ...]:
    """Pack samples in the given order into consecutive microbatches of at most ``max_tokens``."""
    mbs: list[list[int]] = []
    used = 0
    for i in sample_ids:
        if not mbs or used + lengths[i] > max_tokens:
            mbs.append([])
            used = 0
        mbs[-1].append(i)
        used += lengths[i]
    return tuple(tuple(m) for m in mbs)


def round_robin(lengths: Sequence[int], world_size: int, max_tokens: int) -> Assignment:
    """Sample i goes to rank i % W; each rank packs its samples in order under the cap."""
    check_lengths(lengths, max_tokens)
    return tuple(
        pack_greedy(range(r, len(lengths), world_size), lengths, max_tokens) for r in range(world_size)
    )


BALANCERS: dict[str, Balancer] = {"round_robin": round_robin}


def get_balancer(balance: str | Balancer) -> Balancer:
    if callable(balance):
        return balance
    try:
        return BALANCERS[balance]
    except KeyError:
        raise ValueError(f"unknown balancer {balance!r}; known: {sorted(BALANCERS)}") from None
