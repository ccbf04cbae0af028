"""The error vocabulary: a wrong type is a TypeError, a wrong value a ValueError, both naming the
field; bools never pass for ints or numbers."""

import math

import numpy as np
import pytest
import torch

import odcfn
from odcfn._check import ArgTypeError, check_int, check_number
from odcfn.models import QwenConfig


@pytest.mark.parametrize("bad", [True, False, "3", 3.0, None, [3]])
def test_check_int_refuses_wrong_types_by_name(bad):
    with pytest.raises(TypeError, match=r"^steps must be an int >= 1, got "):
        check_int(bad, "steps", at_least=1)


def test_check_int_bounds_and_none():
    assert check_int(np.int64(4), "n", at_least=1) == 4
    assert check_int(None, "n", none_ok=True) is None
    for v in (0, -3):
        with pytest.raises(ValueError, match=r"n must be an int >= 1 and <= 7, got "):
            check_int(v, "n", at_least=1, at_most=7)
    with pytest.raises(ValueError) as info:
        check_int(8, "n", at_least=1, at_most=7)
    assert not isinstance(info.value, TypeError)  # a wrong value is not a wrong type


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.0, -1])
def test_check_number_values(bad):
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        check_number(bad, "lr", positive=True)


def test_check_number_types_and_inf_when_allowed():
    for bad in (True, "1e-3", None, torch.tensor(1.0)):
        with pytest.raises(TypeError, match="lr must be"):
            check_number(bad, "lr", positive=True)
    assert check_number(math.inf, "timeout", positive=True, finite=False) == math.inf
    with pytest.raises(ValueError):
        check_number(math.nan, "timeout", positive=True, finite=False)


def test_a_wrong_type_is_also_a_value_error_for_older_callers():
    assert issubclass(ArgTypeError, TypeError) and issubclass(ArgTypeError, ValueError)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: odcfn.StepConfig(max_tokens_per_microbatch=True), "StepConfig.max_tokens_per_microbatch"),
        (lambda: odcfn.StepConfig(max_grad_norm=True), "StepConfig.max_grad_norm"),
        (lambda: odcfn.Mesh(True, 0), "Mesh.world_size"),
        (lambda: QwenConfig(vocab_size=True), "QwenConfig.vocab_size"),
        (lambda: odcfn.losses.cross_entropy(temperature=True), "temperature"),
        (lambda: odcfn.losses.policy_gradient(kl_loss_coef=False), "kl_loss_coef"),
    ],
)
def test_public_constructors_raise_type_errors_naming_the_field(make, match):
    with pytest.raises(TypeError, match=match):
        make()
