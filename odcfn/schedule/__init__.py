from odcfn.schedule.balance import BALANCERS, get_balancer, round_robin
from odcfn.schedule.plan import (
    AllGather,
    Assignment,
    Backward,
    Forward,
    Gather,
    Plan,
    ReduceScatter,
    Release,
    ScatterAccumulate,
    ScheduleOptions,
    Sync,
    compile_plan,
)

__all__ = [
    "BALANCERS",
    "AllGather",
    "Assignment",
    "Backward",
    "Forward",
    "Gather",
    "Plan",
    "ReduceScatter",
    "Release",
    "ScatterAccumulate",
    "ScheduleOptions",
    "Sync",
    "compile_plan",
    "get_balancer",
    "round_robin",
]
