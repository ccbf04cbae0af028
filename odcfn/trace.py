"""Per-rank event traces, recorded by the runtime and by the simulator in the same format: the
``Event``, the one definition of makespan, bubble rate and throughput that the runtime, the
simulator, the benchmarks and the SFT loop all use, and exports: a Chrome trace (``chrome://tracing`` /
https://ui.perfetto.dev: one process per rank, a compute and a communication lane each) and a
matplotlib timeline like the ODC paper's figure 1.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Event",
    "bubble_rate",
    "chrome_trace",
    "makespan",
    "plot_timeline",
    "samples_per_s",
    "save_chrome_trace",
    "tokens_per_s",
]

COMPUTE_KINDS = ("forward", "backward")
COMM_KINDS = ("gather", "scatter", "collective", "sync")


@dataclass(frozen=True)
class Event:
    rank: int
    kind: str  # forward | backward | gather | scatter | collective | release | sync
    name: str  # the unit (or "" for sync)
    start: float  # seconds, from the start of the step on this rank's clock
    end: float
    mb: int = -1
    nbytes: int = 0  # bytes this rank moved in a communication step (its transport's counters)

    @property
    def duration(self) -> float:
        return self.end - self.start


def makespan(events: Sequence[Event]) -> float:
    return max((e.end for e in events), default=0.0) - min((e.start for e in events), default=0.0)


def bubble_rate(events_per_rank: Sequence[Sequence[Event]], step_time: float | None = None) -> float:
    """1 - (sum over ranks of busy compute time) / (ranks x step time): THE bubble rate, for
    measured and simulated traces alike. A slow device's longer compute is busy time."""
    if not events_per_rank:
        raise ValueError("bubble_rate needs at least one rank's events")
    if step_time is None:
        step_time = max(makespan(evs) for evs in events_per_rank)
    if step_time <= 0:
        return 0.0
    busy = sum(e.duration for evs in events_per_rank for e in evs if e.kind in COMPUTE_KINDS)
    return 1.0 - busy / (len(events_per_rank) * step_time)


def _step_time(events_per_rank: Sequence[Sequence[Event]], step_time: float | None) -> float:
    if step_time is not None:
        return step_time
    if not events_per_rank:
        raise ValueError("need at least one rank's events (or an explicit step_time)")
    return max(makespan(evs) for evs in events_per_rank)


def samples_per_s(
    num_samples: int, events_per_rank: Sequence[Sequence[Event]] = (), step_time: float | None = None
) -> float:
    """Minibatch samples over the step time (the slowest rank's makespan unless given)."""
    t = _step_time(events_per_rank, step_time)
    return num_samples / t if t > 0 else float("inf")


def tokens_per_s(
    num_tokens: int, events_per_rank: Sequence[Sequence[Event]] = (), step_time: float | None = None
) -> float:
    t = _step_time(events_per_rank, step_time)
    return num_tokens / t if t > 0 else float("inf")


# --- Chrome / Perfetto ----------------------------------------------------------------------


def _lane(kind: str) -> int:
    """Thread id inside a rank's process: 0 compute, 1 communication."""
    return 0 if kind in COMPUTE_KINDS or kind == "release" else 1


def chrome_trace(events_per_rank: Sequence[Sequence[Event]], *, label: str = "odcfn") -> dict[str, Any]:
    """The Chrome trace-event JSON object (complete "X" events, microseconds)."""
    out: list[dict[str, Any]] = []
    for r, evs in enumerate(events_per_rank):
        out.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
        for tid, lane in enumerate(("compute", "communication")):
            out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": lane}})
        for e in evs:
            name = f"{e.kind} {e.name}".strip() + (f" mb{e.mb}" if e.mb >= 0 else "")
            out.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": e.kind,
                    "pid": e.rank,
                    "tid": _lane(e.kind),
                    "ts": e.start * 1e6,
                    "dur": max(e.duration, 0.0) * 1e6,
                    "args": {"unit": e.name, "mb": e.mb, **({"bytes": e.nbytes} if e.nbytes else {})},
                }
            )
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"label": label}}


def save_chrome_trace(
    events_per_rank: Sequence[Sequence[Event]], path: str | os.PathLike, *, label: str = "odcfn"
) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(events_per_rank, label=label), f)


# --- the timeline picture ---------------------------------------------------------------------

COLORS = {
    "forward": "#4C9BE8",
    "backward": "#1F5FA8",
    "gather": "#F2A541",
    "scatter": "#E07A5F",
    "collective": "#C0392B",
    "sync": "#7D3C98",
    "idle": "#FFFFFF",
}


def plot_timeline(
    events_per_rank: Sequence[Sequence[Event]],
    path: str | os.PathLike | None = None,
    *,
    title: str = "",
    ax: Any = None,
    step_time: float | None = None,
) -> Any:
    """One lane per rank: compute (forward/backward) in the upper part, communication in a thin
    strip below, idle left white; the bubble rate in the title. Saves a PNG when ``path``."""
    import matplotlib

    if ax is None and path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not events_per_rank:
        raise ValueError("plot_timeline needs at least one rank's events")
    t_end = step_time if step_time is not None else max(makespan(evs) for evs in events_per_rank)
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, min(0.45 * len(events_per_rank) + 1.2, 40.0)))
    for r, evs in enumerate(events_per_rank):
        ax.broken_barh([(0, t_end)], (r - 0.4, 0.8), facecolors=COLORS["idle"], edgecolors="#DDDDDD")
        lanes: dict[str, list[tuple[float, float]]] = {}
        for e in evs:
            if e.duration > 0 and e.kind in COLORS:
                lanes.setdefault(e.kind, []).append((e.start, e.duration))
        for kind, spans in lanes.items():
            if kind in COMPUTE_KINDS:
                ax.broken_barh(spans, (r - 0.4, 0.55), facecolors=COLORS[kind])
            else:
                ax.broken_barh(spans, (r + 0.17, 0.23), facecolors=COLORS[kind])
    ax.set_yticks(range(len(events_per_rank)), [f"rank {r}" for r in range(len(events_per_rank))])
    ax.invert_yaxis()
    ax.set_xlim(0, t_end)
    ax.set_xlabel("time (s)")
    bubble = bubble_rate(events_per_rank, t_end)
    ax.set_title(f"{title + ': ' if title else ''}bubble rate {bubble:.1%}, step {t_end:.4g} s")
    kinds = {e.kind for evs in events_per_rank for e in evs}
    handles = [Patch(color=COLORS[k], label=k) for k in COLORS if k in kinds]
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="idle"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles), fontsize=8)
    if fig is not None:
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
            plt.close(fig)
    return ax
