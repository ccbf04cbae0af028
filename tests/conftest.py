import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI: derandomized, so a red build is reproducible, and without the example database (a CI
# checkout starts clean; nothing a failed run saved can decide a later one). Locally: random
# seeds, to keep finding new cases, and the database in .hypothesis/ replays a found failure
# until it is fixed (a fixed test passes its saved examples like any other).
settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# The in-process ranks are threads; intra-op threads on top would only oversubscribe 2 cores.
torch.set_num_threads(1)

# The session-wide pool of ready worker processes for the multi-process tests.
from tests.mp_pool import mp_pool, warm_for  # noqa: E402, F401
from tests.precompile import precompile  # noqa: E402


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a serial run), before any worker
        precompile(config)

# The longest test files (and notebooks), with their wall seconds on 2 cores under the suite's own
# load (docs/design.md's testing section). Each entry is a group that stays on one worker, in
# order: a module-scoped fixture (a compile, an uninterrupted reference run) is built once.
SLOW = {
    "tests/sft/test_trackers.py": 84,
    "tests/sft/test_recovery_kill.py": 67,
    "tests/bench/test_moe_bench.py": 60,
    "tests/transport/test_gpu_check.py": 55,
    "tests/transport/test_transport_conformance.py": 50,
    "tests/checkpoint/test_recovery_nodes.py": 50,
    "tests/step/test_multiprocess.py": 44,
    "tests/transport/test_gpu_compile.py": 40,
    "tests/sft/test_train_staleness.py": 35,
    "tests/data/test_chat_data.py": 30,
    "tests/launch/test_launcher_death.py": 29,
    "tests/kernels/test_fused_head_triton.py": 26,
    "tests/transport/test_heartbeat.py": 25,
    "tests/step/test_fsdp2_parity.py": 25,
    "tests/launch/test_launch.py": 24,
    "tests/step/test_staleness_convergence.py": 22,
    "tests/sft/test_multinode.py": 18,
    "tests/test_notebooks.py::test_notebook_runs[staleness]": 17,
    "tests/test_notebooks.py::test_notebook_runs[grpo]": 16,
    "tests/test_notebooks.py::test_notebook_runs[quickstart]": 15,
    "tests/test_notebooks.py::test_notebook_runs[rl_loop]": 11,
    "tests/test_notebooks.py::test_notebook_runs[preference]": 10,
    "tests/test_notebooks.py::test_notebook_runs[moe]": 10,
}


def deal(items: list, workers: int) -> list:
    """The collection reordered so that each xdist worker starts with its share of the slow
    groups (dealt longest first to the least loaded worker), then everything else in collection
    order. pytest-xdist's ``load`` scheduler (3.x) first hands each worker a chunk of
    consecutive items, ``len(items) // workers // 4`` of them: with the slow tests merely moved
    to the front, one worker got all of them and finished 100 s after the other three."""
    groups: dict[str, list] = {}
    rest = []
    for item in items:
        key = next((p for p in SLOW if item.nodeid.startswith(p)), None)
        (groups.setdefault(key, []) if key else rest).append(item)
    if workers <= 1:
        return [i for k in sorted(groups, key=SLOW.get, reverse=True) for i in groups[k]] + rest
    bins: list[list] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for key in sorted(groups, key=SLOW.get, reverse=True):
        k = load.index(min(load))
        bins[k] += groups[key]
        load[k] += SLOW[key]
    chunk = max(len(items) // workers // 4, 2)
    out = []
    for b in bins:  # a worker's first chunk: its slow groups, topped up with quick tests
        out += b
        fill = max(chunk - len(b), 0)
        out += rest[:fill]
        rest = rest[fill:]
    return out + rest


def pytest_collection_modifyitems(session, config, items):
    items[:] = deal(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    warm_for(items)  # the workers import torch while the single-process tests run


@pytest.fixture
def shm():
    """A fresh directory under /dev/shm for a run's segments and snapshots (``ODCFN_SHM_DIR``),
    so a test can assert that nothing is left in it; removed afterwards."""
    d = Path("/dev/shm") / f"odcfn-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)
