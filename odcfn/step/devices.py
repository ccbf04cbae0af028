"""Where a rank's shards live, and so where its compute runs.

Every shard of a rank lives on one device, the compute device, with one exception: an offloaded
state (``StepConfig(offload=...)``, ``odcfn.step.offload_store``) keeps its trained units'
masters in host memory (pinned on CUDA, or a file mapping) and their resident published copies
on the compute device, while its frozen units (LoRA's base: never offloaded, only gathered) stay
on the compute device. On a GPU with LoRA the state's params are then partly host views and
partly device tensors, legitimately; any other mix (a resident shard on another device, an
offloaded master off the host, a published copy elsewhere) is refused, naming the unit.

``compute_device`` decides from the devices alone (a pure function: testable on a machine
without a GPU by naming devices), ``state_device`` reads them off a state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from odcfn.step.offload_store import store_of
from odcfn.trainable import trainable_names

__all__ = ["compute_device", "offloaded_copies", "state_device"]

_ONE = "all shards of a rank live on one device (an offloaded state's trained masters excepted: host memory)"


def compute_device(
    shards: Mapping[str, torch.device],
    published: Mapping[str, torch.device] | None = None,
    what: str = "params",
) -> torch.device:
    """The compute device of a rank whose units' shards are on ``shards`` (unit -> device);
    ``published``: the offloaded units' resident published copies (unit -> device; empty when
    nothing is offloaded). A ``ValueError`` naming the unit for any other layout:

    - the units that are not offloaded, and the offloaded units' published copies, all on one
      device (the compute device);
    - every offloaded unit's master in host memory (``cpu``: pinned or mapped)."""
    published = dict(published or {})
    if not shards:
        raise ValueError(f"{what} holds no units")
    odd = sorted(set(published) - set(shards))
    if odd:
        raise ValueError(f"published copies of units {odd} that {what} does not hold")
    resident = {u: torch.device(d) for u, d in shards.items() if u not in published}
    copies = {u: torch.device(d) for u, d in published.items()}
    anchor, device = next(iter(resident.items())) if resident else next(iter(copies.items()))
    where = f"{what}[{anchor!r}]" if resident else f"the published copy of {anchor!r}"
    for u, d in resident.items():
        if d != device:
            raise ValueError(f"{what}[{u!r}] is on {d} but {where} is on {device}: {_ONE}")
    for u, d in copies.items():
        master = torch.device(shards[u])
        if master.type != "cpu":
            raise ValueError(
                f"{what}[{u!r}] is offloaded (StepConfig.offload) but its master is on {master}: an "
                "offloaded master lives in host memory"
            )
        if d != device:
            raise ValueError(
                f"the published copy of offloaded {what}[{u!r}] is on {d} but {where} is on {device}: "
                "the published copies live where the step computes"
            )
    return device


def offloaded_copies(state: Any) -> dict[str, torch.Tensor]:
    """The resident published copies of ``state``'s offloaded units (empty: nothing offloaded,
    or a state not yet in its store, whose shards then all live on one device)."""
    if getattr(state.config, "offload", None) is None:
        return {}
    trained = list(trainable_names(state.model))
    store = store_of(state.params, state.opt_state, trained) if trained else None
    return {} if store is None else dict(store.published)


def state_device(state: Any, what: str = "params") -> torch.device:
    """``compute_device`` of ``state`` (its params and its offloaded units' published copies)."""
    copies = offloaded_copies(state)
    return compute_device(
        {u: t.device for u, t in state.params.items()}, {u: t.device for u, t in copies.items()}, what
    )
