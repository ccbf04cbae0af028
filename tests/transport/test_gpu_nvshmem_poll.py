"""NVSHMEM signal polling on the host side, with CUDA streams mocked: a poll copies the word on
the polling thread's own stream and never touches (or waits for) the compute stream."""

from __future__ import annotations

import threading

import torch


def test_nvshmem_signal_reads_poll_on_a_side_stream_not_the_compute_stream(monkeypatch):
    """A poll must not queue behind compute: the word is copied on the polling thread's own
    stream, which alone is synchronised; each thread (main, drain) gets its own."""
    from odcfn.transport.gpu import nvshmem as nvmod

    fab = object.__new__(nvmod.NvshmemFabric)  # host side only: no NVSHMEM, no GPU
    fab.device, fab._poll = torch.device("cpu"), threading.local()
    fab.sig = torch.zeros(16, dtype=torch.int64)
    events: list = []

    class Stream:
        def __init__(self, device=None):
            self.name = f"poll{len([e for e in events if e[0] == 'new'])}"
            events.append(("new", self.name))

        def synchronize(self):
            events.append(("sync", self.name))

    class Ctx:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            events.append(("enter", self.stream.name))

        def __exit__(self, *a):
            events.append(("exit", self.stream.name))

    def compute_stream(*a, **k):
        raise AssertionError("a poll touched the compute stream")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    monkeypatch.setattr(torch.cuda, "current_stream", compute_stream)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: compute_stream())
    fab.sig[5] = 42
    assert fab.signal_read(5) == 42 and fab.signal_read(5) == 42
    assert events == [("new", "poll0"), ("enter", "poll0"), ("exit", "poll0"), ("sync", "poll0")] + [
        ("enter", "poll0"), ("exit", "poll0"), ("sync", "poll0")]  # fmt: skip
    got = []
    t = threading.Thread(target=lambda: got.append(fab.signal_read(5)))
    t.start()
    t.join()
    assert got == [42] and ("new", "poll1") in events  # the drain thread polls on its own stream
