"""The /dev/shm transports publish "data, then flag" with plain stores, correct on x86-64 only:
other architectures are refused at construction, before any rendezvous (as the CUDA IPC fabric
refuses a CPU arena), rather than risk torn reads."""

from __future__ import annotations

import platform

import pytest

import odcfn
from odcfn.transport.shm import ShmTransport
from odcfn.transport.shm_collective import ShmCollectives
from odcfn.transport.shm_sync import check_store_order


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", ""])
@pytest.mark.parametrize("cls", [ShmTransport, ShmCollectives])
def test_shared_memory_transports_refuse_a_cpu_that_reorders_stores(monkeypatch, cls, machine):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    said = rf"{cls.__name__} relies on x86-64 store ordering.*this machine is {machine or 'unknown'}"
    with pytest.raises(RuntimeError, match=said):
        cls(odcfn.Mesh(2, 0), timeout=1)  # no peer exists: the refusal comes before any rendezvous


@pytest.mark.parametrize("machine", ["x86_64", "AMD64"])
def test_x86_is_accepted(monkeypatch, machine):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    check_store_order("ShmTransport")
