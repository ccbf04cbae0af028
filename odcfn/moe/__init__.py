"""Mixture-of-Experts pieces shared by the models (``odcfn.models.moe``) and the executor
(``odcfn.step``): routing (``router``) and routed expert compute over an expert source
(``experts``)."""

from odcfn.moe.experts import ExpertSource, LocalExperts, OnDemandExperts, expert_ffn, routed_ffn
from odcfn.moe.router import RouterLog, RouterSpec, route

__all__ = [
    "ExpertSource",
    "LocalExperts",
    "OnDemandExperts",
    "RouterLog",
    "RouterSpec",
    "expert_ffn",
    "route",
    "routed_ffn",
]
