"""odcfn: FSDP training with On-Demand Communication, JAX-style over PyTorch."""

from odcfn.batch import Batch, Microbatch, Sample, pack, random_batch
from odcfn.kernels import Counters, LocalWorld, Transport, TransportError, run_local
from odcfn.model import Model, Unit, check_params, reference_loss
from odcfn.optim import Optimizer, adamw, clip_scale, sgd
from odcfn.reference import reference_value_and_grad
from odcfn.schedule import Plan, ScheduleOptions, compile_plan, get_balancer
from odcfn.sharding import Layout, Mesh, make_layout, shard, unshard
from odcfn.trace import Event, bubble_rate
from odcfn.train import StepMetrics, grad_step, train_step
from odcfn.tree import tree_allclose, tree_assert_allclose, tree_map

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Counters",
    "Event",
    "Layout",
    "LocalWorld",
    "Mesh",
    "Microbatch",
    "Model",
    "Optimizer",
    "Plan",
    "Sample",
    "ScheduleOptions",
    "StepMetrics",
    "Transport",
    "TransportError",
    "Unit",
    "adamw",
    "bubble_rate",
    "check_params",
    "clip_scale",
    "compile_plan",
    "get_balancer",
    "grad_step",
    "make_layout",
    "pack",
    "random_batch",
    "reference_loss",
    "reference_value_and_grad",
    "run_local",
    "sgd",
    "shard",
    "train_step",
    "tree_allclose",
    "tree_assert_allclose",
    "tree_map",
    "unshard",
]
