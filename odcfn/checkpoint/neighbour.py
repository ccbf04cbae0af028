"""The wire of the memory tier across nodes: node leaders send snapshot files to each other over TCP.

Each node leader (local rank 0) runs an ``Inbox``: a listening socket and a thread per connection
that receives files into ``<tier>/.recv-<step>/``. A message is::

    8 bytes   big-endian length n of the header (at most 64 KiB)
    n bytes   the header: JSON sealed with HMAC-SHA256 under the job secret (kernels/rdzv.py)
    payload   exactly header["bytes"] raw bytes

The header names the run, the step, the file (``rank-NNNNN.safetensors`` or ``manifest.json``),
its size, its sha256 and the node it is for. The receiver authenticates the header before it
reads a byte of payload, streams the payload to a temporary file while hashing it, and renames
the file into place only if size and sha256 match the (authenticated) header: a forged,
truncated or corrupted message leaves nothing, and is reported by the next ``wait`` that times
out. Nothing received is unpickled or executed: JSON and bytes written to a file.

``exchange_addresses`` tells every rank where each node leader listens, through the transport's
collectives (an all-reduce of plain integers, the same way the shm transport agrees on a name).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from odcfn.checkpoint.commit import CheckpointError, fsync_path
from odcfn.transport.base import TransportError, world_group
from odcfn.transport.rdzv import seal, unseal

__all__ = ["Inbox", "advertised_host", "exchange_addresses", "send_files"]

_MAX_HEADER = 1 << 16
_NAME = re.compile(r"rank-\d{5}\.safetensors|manifest\.json")
_HOST_BYTES = 64
_POLL = 0.01


def _key(run: str) -> str:
    return f"odcfn-snapshot/{run}"


def recv_dir(root: Path, step: int) -> Path:
    return root / f".recv-{step:08d}"


def advertised_host() -> str:
    """The address peers reach this node at: ``ODCFN_SNAPSHOT_HOST`` if set, else the address of
    the interface that routes to ``MASTER_ADDR`` (loopback for a job on one machine)."""
    if host := os.environ.get("ODCFN_SNAPSHOT_HOST"):
        return host
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master), 9))  # no packet is sent: routing only
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class Inbox:
    """A node leader's receiver of snapshot files from the other nodes' leaders."""

    def __init__(self, root: Path, secret: bytes, run: str, node: int, host: str) -> None:
        self.root, self.secret, self.run, self.node = root, secret, run, node
        self.refused: list[str] = []  # why messages were dropped (named by a wait that times out)
        self.got: dict[tuple[int, str], dict[str, Any]] = {}  # (step, name) -> its header
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, name="odcfn-snapshot-inbox", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        with conn:
            conn.settimeout(60.0)
            try:
                while (head := _read_header(conn)) is not None:
                    self._receive(
                        conn, self._check(unseal(self.secret, _key(self.run), head, f"node at {peer}"))
                    )
            except (OSError, ValueError, TransportError) as e:
                with self._lock:
                    self.refused = [*self.refused[-15:], f"from {peer[0]}:{peer[1]}: {e}"]  # the latest

    def _check(self, h: dict[str, Any]) -> dict[str, Any]:
        ok = (
            h.get("to") == self.node
            and isinstance(h.get("name"), str)
            and _NAME.fullmatch(h["name"])
            and isinstance(h.get("step"), int)
            and h["step"] >= 0
            and isinstance(h.get("bytes"), int)
            and 0 <= h["bytes"] < 1 << 44
            and isinstance(h.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", h["sha256"])
        )
        if not ok:
            raise ValueError(f"a malformed or misaddressed header (refused): {json.dumps(h)[:200]}")
        return h

    def _receive(self, conn: socket.socket, h: dict[str, Any]) -> None:
        where = recv_dir(self.root, h["step"])
        where.mkdir(parents=True, exist_ok=True)
        final = where / h["name"]
        tmp = where / f".{h['name']}.{os.getpid()}.{time.monotonic_ns()}"
        digest, left = hashlib.sha256(), h["bytes"]
        try:
            with open(tmp, "wb") as f:
                while left:
                    chunk = conn.recv(min(left, 1 << 22))
                    if not chunk:
                        raise ValueError(
                            f"{h['name']} of step {h['step']}: the connection closed {left} bytes early"
                        )
                    digest.update(chunk)
                    f.write(chunk)
                    left -= len(chunk)
            if digest.hexdigest() != h["sha256"]:
                raise ValueError(f"{h['name']} of step {h['step']} does not match the sha256 of its header")
            fsync_path(tmp)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self.got[(h["step"], h["name"])] = h

    def wait(self, step: int, names: Iterable[str], timeout: float, what: str) -> dict[str, dict[str, Any]]:
        """The headers of ``names`` of ``step`` once all have arrived (their files are in
        ``recv_dir``); ``TimeoutError`` naming ``what`` and any refused message otherwise."""
        names = sorted(set(names))
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                missing = [n for n in names if (step, n) not in self.got]
                if not missing:
                    return {n: self.got[(step, n)] for n in names}
                refused = list(self.refused)
            if time.monotonic() > deadline:
                why = f"; refused: {'; '.join(refused[-3:])}" if refused else ""
                raise TimeoutError(
                    f"snapshot: timed out after {timeout}s waiting for {missing} of step "
                    f"{step} from {what}{why}"
                )
            time.sleep(_POLL)

    def forget(self, up_to: int) -> None:
        with self._lock:
            for k in [k for k in self.got if k[0] <= up_to]:
                del self.got[k]

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


def _read_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            if buf:
                raise ValueError("the connection closed inside a header")
            return None
        buf += chunk
    return bytes(buf)


def _read_header(conn: socket.socket) -> bytes | None:
    raw = _read_exact(conn, 8)
    if raw is None:
        return None  # the sender is done
    (n,) = struct.unpack(">Q", raw)
    if not 0 < n <= _MAX_HEADER:
        raise ValueError(f"a header of {n} bytes (at most {_MAX_HEADER}; refused)")
    head = _read_exact(conn, n)
    if head is None:
        raise ValueError("the connection closed inside a header")
    return head


def send_files(
    address: tuple[str, int],
    files: Sequence[tuple[str, Path]],
    *,
    step: int,
    to: int,
    run: str,
    secret: bytes,
    timeout: float,
    sha: dict[str, str] | None = None,
) -> None:
    """Send ``files`` (``(name, path)``) of ``step`` to the inbox of node ``to`` at ``address``.
    ``sha``: known sha256 by name (else computed here); ``CheckpointError`` naming the peer."""
    from odcfn.checkpoint.verify import sha256

    try:
        with socket.create_connection(address, timeout=timeout) as conn:
            for name, path in files:
                size = path.stat().st_size
                digest = (sha or {}).get(name) or sha256(path)
                head = seal(
                    secret, _key(run), {"to": to, "name": name, "step": step, "bytes": size, "sha256": digest}
                )
                conn.sendall(struct.pack(">Q", len(head)) + head)
                with open(path, "rb") as f:
                    if conn.sendfile(f) != size:
                        raise OSError(f"{path} changed size while it was sent")
    except OSError as e:
        raise CheckpointError(
            f"snapshot: sending {[n for n, _ in files]} of step {step} to node {to} at "
            f"{address[0]}:{address[1]} failed: {e}"
        ) from e


def exchange_addresses(
    collectives: Any, mesh: Any, mine: tuple[str, int] | None
) -> dict[int, tuple[str, int]]:
    """Every node leader's inbox address, on every rank (a collective: every rank calls, the node
    leaders with their ``mine``): integers in an all-reduce, decoded and checked here."""
    width = 2 + _HOST_BYTES
    table = torch.zeros(mesh.world_size, width, dtype=torch.int64)
    if mine is not None:
        host = mine[0].encode("ascii")
        if len(host) > _HOST_BYTES:
            raise ValueError(f"snapshot host {mine[0]!r} is longer than {_HOST_BYTES} bytes")
        table[mesh.rank, 0], table[mesh.rank, 1] = mine[1], len(host)
        table[mesh.rank, 2 : 2 + len(host)] = torch.tensor(list(host), dtype=torch.int64)
    table = collectives.all_reduce(world_group(mesh), table)
    out = {}
    for node in range(mesh.num_nodes):
        row = table[node * mesh.node_size].tolist()
        port, n = row[0], row[1]
        raw = row[2 : 2 + n] if 0 < n <= _HOST_BYTES else []
        if not 0 < port < 65536 or not raw or not all(32 < b < 127 for b in raw):
            raise TransportError(f"snapshot: node {node}'s leader sent no valid address (port {port})")
        out[node] = (bytes(raw).decode("ascii"), port)
    return out
