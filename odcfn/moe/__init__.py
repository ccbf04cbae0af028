"""Mixture-of-Experts pieces shared by the models (``odcfn.models.moe``) and the executor
(``odcfn.step``): routing (``router``) and routed expert compute over an expert source
(``experts``)."""

from odcfn.moe.experts import ExpertSource, LocalExperts, OnDemandExperts, expert_ffn, routed_ffn
from odcfn.moe.router import ROUTED_EXTRA, RouterLog, RouterSpec, check_routing, route

__all__ = [
    "ROUTED_EXTRA",
    "ExpertSource",
    "LocalExperts",
    "OnDemandExperts",
    "RouterLog",
    "RouterSpec",
    "check_routing",
    "expert_ffn",
    "route",
    "routed_ffn",
]
