from odcfn.sharding.layout import Layout, UnitLayout, make_layout, shard, unshard
from odcfn.sharding.mesh import Mesh

__all__ = ["Layout", "Mesh", "UnitLayout", "make_layout", "shard", "unshard"]
