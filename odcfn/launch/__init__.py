"""Launching ranks: ``launch`` (local processes, restarts, the job's store and secret;
``launcher.py``) and a rank that dies with its launcher (``orphan.py``). Re-exports only."""

from odcfn.launch.launcher import (
    LaunchError,
    check_job_store,
    free_port,
    host_store,
    launch,
    rank_env,
    sweep_shm,
)
from odcfn.launch.orphan import die_with_parent, parent_death_signal

__all__ = [
    "LaunchError",
    "check_job_store",
    "die_with_parent",
    "free_port",
    "host_store",
    "launch",
    "parent_death_signal",
    "rank_env",
    "sweep_shm",
]
