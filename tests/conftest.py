import os

import torch
from hypothesis import HealthCheck, settings

# CI: derandomized, so a red build is reproducible; locally: random, to keep finding new cases.
settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# The in-process ranks are threads; intra-op threads on top would only oversubscribe 2 cores.
torch.set_num_threads(1)

# The session-wide pool of ready worker processes for the multi-process tests.
from tests.mp_pool import mp_pool, warm_for  # noqa: E402, F401


def pytest_collection_modifyitems(session, config, items):
    warm_for(items)  # the workers import torch while the single-process tests run
