"""Hostile inputs on the rendezvous store: nothing read from it is unpickled or called, forged
or foreign values are refused, paths must be this job's own files."""

from __future__ import annotations

import os
import pickle
import re
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import HashStore

import odcfn
from odcfn.transport.base import TransportError
from odcfn.transport.gpu.cuda_ipc import IpcFabric
from odcfn.transport.rdzv import job_secret, seal, unseal

ROOT = Path(__file__).parents[2]


class _Evil:
    """Unpickling this creates ``marker``: the attack a pickled store value allows."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _store():
    s = HashStore()
    s.set_timeout(timedelta(seconds=5))
    return s


def _setup_rank0(store, key="job/arena/1", shm_dir="/dev/shm"):
    fab = IpcFabric(odcfn.Mesh(2, 0), store, "cpu", shm_dir=shm_dir, timeout=2)
    try:
        fab.setup(4096, 8, key)
    finally:
        fab.close()


def _prefix_files(prefix: str) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


@pytest.fixture
def job(monkeypatch):
    prefix = f"odcfn-hostile-{os.getpid()}-{threading.get_ident() % 10000}"
    monkeypatch.setenv("ODCFN_SHM_PREFIX", prefix)
    monkeypatch.setenv("ODCFN_JOB_SECRET", "ab" * 32)
    yield prefix
    for f in _prefix_files(prefix):
        os.unlink(os.path.join("/dev/shm", f))


def test_a_pickled_store_value_is_refused_and_never_run(job, tmp_path):
    marker = tmp_path / "pwned"
    store = _store()
    store.set("job/arena/1/1", pickle.dumps({"arena": ("cuda", (_Evil(str(marker)), ()))}))
    with pytest.raises(TransportError, match="rank 1 .* not an odcfn record"):
        _setup_rank0(store)
    assert not marker.exists()
    assert _prefix_files(job) == []  # our own files went with the error


def test_a_value_sealed_under_another_secret_is_refused(job):
    store = _store()
    forged = {"rank": 1, "sig": f"/dev/shm/{job}-ipc-x.sig", "nbytes": 4096, "arena": {"kind": "file"}}
    store.set("job/arena/1/1", seal(b"another job's secret", "job/arena/1/1", forged))
    with pytest.raises(TransportError, match="failed authentication"):
        _setup_rank0(store)
    # a genuine value replayed under another key (another generation) fails the same way
    store2 = _store()
    store2.set("job/arena/1/1", seal(bytes.fromhex("ab" * 32), "job/arena/0/1", forged))
    with pytest.raises(TransportError, match="failed authentication"):
        _setup_rank0(store2)
    assert _prefix_files(job) == []


@pytest.mark.parametrize("where", ["outside", "symlink", "foreign"])
def test_authentic_records_must_name_this_jobs_own_files(job, where, tmp_path):
    store, key = _store(), "job/arena/1/1"
    path = f"/dev/shm/{job}-ipc-peer.sig"
    if where == "outside":
        path = "/etc/passwd"
    elif where == "symlink":
        os.symlink("/etc/passwd", path)
    else:  # another user's file with the right name (root in CI can create one)
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        os.ftruncate(fd, 64)
        os.close(fd)
        if os.getuid() != 0:
            pytest.skip("needs root to make a file of another uid")
        os.chown(path, 4242, 4242)
    record = {"rank": 1, "sig": path, "nbytes": 4096, "arena": {"kind": "file", "path": path}}
    store.set(key, seal(bytes.fromhex("ab" * 32), key, record))
    msg = {
        "outside": "not under this job's",
        "symlink": "not a regular file",
        "foreign": "belongs to uid 4242",
    }
    with pytest.raises(TransportError, match=msg[where]):
        _setup_rank0(store)


def test_without_an_env_secret_ranks_derive_one_only_this_user_can_read(monkeypatch, tmp_path):
    monkeypatch.delenv("ODCFN_JOB_SECRET", raising=False)
    a, b = job_secret("s1", str(tmp_path)), job_secret("s1", str(tmp_path))
    assert a == b and len(a) == 32 and job_secret("s2", str(tmp_path)) != a
    assert (tmp_path / "s1").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1", "s2"]  # no temporaries left
    # a secret file someone could read (or plant) is refused
    (tmp_path / "s3").write_bytes(b"x" * 32)
    os.chmod(tmp_path / "s3", 0o644)
    with pytest.raises(TransportError, match="readable by others"):
        job_secret("s3", str(tmp_path))
    monkeypatch.setenv("ODCFN_JOB_SECRET", "not hex")
    with pytest.raises(ValueError, match="ODCFN_JOB_SECRET must be hex"):
        job_secret("s1", str(tmp_path))


def test_unseal_rejects_tampered_bodies():
    raw = seal(b"k" * 32, "key", {"nbytes": 1})
    assert unseal(b"k" * 32, "key", raw, "rank 1") == {"nbytes": 1}
    tampered = raw.replace(b'\\"nbytes\\": 1', b'\\"nbytes\\": 2')
    assert tampered != raw
    with pytest.raises(TransportError, match="failed authentication"):
        unseal(b"k" * 32, "key", tampered, "rank 1")


def test_ipc_segment_files_are_private(job):
    """The arena/signal files exist only during setup, but while they do, only we may open them."""
    inner, seen = _store(), []

    class Spy:  # at the "mapped" count every file of the rendezvous still exists
        get, set = inner.get, inner.set

        def add(self, k, n):
            for f in _prefix_files(job):
                try:
                    seen.append(os.stat(f"/dev/shm/{f}").st_mode & 0o777)
                except FileNotFoundError:  # the other rank just unlinked its own
                    pass
            return inner.add(k, n)

    fab = [IpcFabric(odcfn.Mesh(2, r), Spy(), "cpu", timeout=10) for r in range(2)]
    ts = [threading.Thread(target=f.setup, args=(4096, 8, "j/arena/1")) for f in fab]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    for f in fab:
        f.close()
    assert seen and set(seen) == {0o600}
    assert _prefix_files(job) == []


def test_nothing_from_a_store_or_socket_is_unpickled_in_the_library():
    """broadcast_object_list / all_gather_object / pickle.loads unpickle what arrives. The only
    pickle left is odcfn.launch's pipe to its own children (an anonymous pipe, not a socket)."""
    pat = re.compile(r"pickle\.loads?\(|_object_list\(|gather_object\(|scatter_object|\beval\(|\bexec\(")
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in (ROOT / "odcfn").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pat.search(line)
    ]
    assert all(h.startswith("odcfn/launch/launcher.py:") for h in hits), hits
