"""The single-process reference every sharded path is tested against: ``torch.func`` on the
unsharded pytree over the whole minibatch."""

from __future__ import annotations

import torch

from odcfn.batch import Batch
from odcfn.model import Model, reference_loss
from odcfn.tree import PyTree

__all__ = ["reference_value_and_grad"]


def reference_value_and_grad(model: Model, params: PyTree, batch: Batch) -> tuple[torch.Tensor, PyTree]:
    grads, loss = torch.func.grad_and_value(lambda p: reference_loss(model, p, batch))(params)
    return loss, grads
