"""odcfn: FSDP training with On-Demand Communication, JAX-style over PyTorch."""

from odcfn import lora, losses, preference, trainable
from odcfn.batch import Batch, Microbatch, Sample, pack, random_batch
from odcfn.checkpoint.state_io import load, save
from odcfn.launch import LaunchError, launch
from odcfn.model import Model, Unit, check_params, reference_loss
from odcfn.optim import Optimizer, adamw, clip_scale, sgd
from odcfn.preference import preference_batch, with_ref_logprobs
from odcfn.preference.lora import lora_reference
from odcfn.reference import reference_value_and_grad
from odcfn.schedule import POLICIES, Plan, ScheduleOptions, WorkStealing, compile_plan, get_balancer
from odcfn.schedule.measure import calibrate
from odcfn.sharding import Layout, Mesh, make_layout, shard, unshard
from odcfn.step.frozen_quant import StateBytes, state_bytes
from odcfn.step.logprobs import gather_params, log_probs
from odcfn.step.offload_config import Offload
from odcfn.step.state import StepConfig, StepMetrics, TrainState
from odcfn.step.train import grad_step, train_step
from odcfn.trace import Event, bubble_rate, chrome_trace, plot_timeline, save_chrome_trace
from odcfn.transport import (
    CollectiveTransport,
    Counters,
    LocalWorld,
    ShmTransport,
    Transport,
    TransportError,
    run_local,
)
from odcfn.tree import tree_allclose, tree_assert_allclose, tree_map

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "CollectiveTransport",
    "Counters",
    "Event",
    "LaunchError",
    "Layout",
    "LocalWorld",
    "Mesh",
    "Microbatch",
    "Model",
    "Offload",
    "Optimizer",
    "POLICIES",
    "Plan",
    "Sample",
    "ScheduleOptions",
    "ShmTransport",
    "StateBytes",
    "StepConfig",
    "StepMetrics",
    "TrainState",
    "Transport",
    "TransportError",
    "Unit",
    "WorkStealing",
    "adamw",
    "bubble_rate",
    "calibrate",
    "check_params",
    "chrome_trace",
    "clip_scale",
    "compile_plan",
    "gather_params",
    "get_balancer",
    "grad_step",
    "launch",
    "log_probs",
    "lora",
    "lora_reference",
    "losses",
    "load",
    "make_layout",
    "pack",
    "preference",
    "preference_batch",
    "plot_timeline",
    "random_batch",
    "reference_loss",
    "reference_value_and_grad",
    "run_local",
    "save",
    "state_bytes",
    "save_chrome_trace",
    "sgd",
    "shard",
    "train_step",
    "trainable",
    "tree_allclose",
    "tree_assert_allclose",
    "tree_map",
    "unshard",
    "with_ref_logprobs",
]
