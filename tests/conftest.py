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

# The longest tests (about 20 s and up on 2 cores, docs/design.md's testing section), longest first.
# They go to the front so that xdist's round-robin first hand-out gives each worker its share of
# them, instead of one worker meeting the longest test last while the others sit idle.
LONGEST_FIRST = (
    "tests/test_notebooks.py::test_notebook_runs[grpo]",
    "tests/transport/test_gpu_compile.py",
    "tests/sft/test_recovery_kill.py",
    "tests/bench/test_moe_bench.py",
    "tests/test_notebooks.py::test_notebook_runs",
    "tests/launch/test_launcher_death.py",
    "tests/transport/test_gpu_check.py",
    "tests/checkpoint/test_recovery_nodes.py",
    "tests/bench/",
    "tests/sft/test_train_staleness.py",
    "tests/transport/test_heartbeat.py",
)


def _rank(item) -> int:
    return next((i for i, p in enumerate(LONGEST_FIRST) if item.nodeid.startswith(p)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_rank)  # stable: the rest keep their order
    warm_for(items)  # the workers import torch while the single-process tests run


@pytest.fixture
def shm():
    """A fresh directory under /dev/shm for a run's segments and snapshots (``ODCFN_SHM_DIR``),
    so a test can assert that nothing is left in it; removed afterwards."""
    d = Path("/dev/shm") / f"odcfn-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)
