"""Authenticated plain-data rendezvous values over a torch.distributed Store.

torch's TCPStore listens on all interfaces and accepts any client that can reach its port, with
no authentication, and its keys are predictable. So a value read from it is untrusted input:

- it is JSON (never pickle, never a callable): ``seal``/``unseal``;
- it carries an HMAC-SHA256 over (key, body) under a per-job secret that the store never sees:
  a forged or replayed-under-another-key value fails ``unseal`` with ``TransportError``;
- paths in it must name this job's own regular files under the shm directory, owned by this
  user (``check_shm_path``).

The secret (``job_secret``): ``ODCFN_JOB_SECRET`` (hex) if set (``odcfn.launch`` sets a fresh one
per job; under torchrun export the same value on every node). Without it, the ranks of one node
derive one through a 0600 file in the shm directory that only this user can read: the first rank
links it into place atomically, the others read it; a file owned by anyone else is refused. The
fabrics that use it (CUDA IPC) span one node, so a node-local secret is enough there.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import stat
from typing import Any

from odcfn.transport.base import TransportError

__all__ = ["b64", "check_shm_path", "job_secret", "seal", "unb64", "unseal"]

SECRET_ENV = "ODCFN_JOB_SECRET"
_SECRET_BYTES = 32


def _check_own_file(path: str, what: str) -> os.stat_result:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise TransportError(f"{what} {path} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise TransportError(f"{what} {path} is not a regular file (refused)")
    if st.st_uid != os.getuid():
        raise TransportError(f"{what} {path} belongs to uid {st.st_uid}, not to this user (refused)")
    if st.st_mode & 0o077:
        raise TransportError(f"{what} {path} is readable by others (mode {oct(st.st_mode & 0o777)}; refused)")
    return st


def job_secret(name: str, shm_dir: str) -> bytes:
    """This job's rendezvous secret: ``ODCFN_JOB_SECRET`` or a node-local one named ``name``."""
    env = os.environ.get(SECRET_ENV)
    if env:
        try:
            key = bytes.fromhex(env)
        except ValueError:
            raise ValueError(
                f"{SECRET_ENV} must be hex (e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
            ) from None
        if len(key) < 16:
            raise ValueError(f"{SECRET_ENV} must hold at least 16 bytes (32 hex digits), got {len(key)}")
        return key
    final = os.path.join(shm_dir, name)
    tmp = f"{final}.{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_bytes(_SECRET_BYTES))
    finally:
        os.close(fd)
    try:
        os.link(tmp, final)  # atomic and exclusive: exactly one rank's bytes become the secret
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    _check_own_file(final, "the job secret file")
    with open(final, "rb") as f:
        key = f.read()
    if len(key) != _SECRET_BYTES:
        raise TransportError(f"the job secret file {final} holds {len(key)} bytes, expected {_SECRET_BYTES}")
    return key


def _mac(secret: bytes, key: str, body: str) -> str:
    return hmac.new(secret, key.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()


def seal(secret: bytes, key: str, payload: dict[str, Any]) -> bytes:
    """``payload`` (plain JSON data) as a store value authenticated for ``key``."""
    body = json.dumps(payload, sort_keys=True)
    return json.dumps({"body": body, "mac": _mac(secret, key, body)}).encode()


def unseal(secret: bytes, key: str, raw: bytes, who: str) -> dict[str, Any]:
    """The payload of a value ``seal`` made for ``key``; ``TransportError`` naming ``who`` if it
    is not JSON, not authenticated by this job's secret, or not a JSON object."""
    try:
        outer = json.loads(raw)
        body, mac = outer["body"], outer["mac"]
        if not isinstance(body, str) or not isinstance(mac, str):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise TransportError(
            f"the rendezvous value of {who} at {key!r} is not an odcfn record (refused)"
        ) from None
    if not hmac.compare_digest(mac, _mac(secret, key, body)):
        raise TransportError(
            f"the rendezvous value of {who} at {key!r} failed authentication: written by another "
            f"job or user, or ranks hold different {SECRET_ENV} (refused)"
        )
    payload = json.loads(body)
    if not isinstance(payload, dict):
        raise TransportError(f"the rendezvous value of {who} at {key!r} is not a JSON object")
    return payload


def check_shm_path(path: Any, shm_dir: str, prefix: str) -> str:
    """``path`` if it is this user's own regular file directly in ``shm_dir`` whose name starts
    with ``prefix``; else ``TransportError``."""
    if not isinstance(path, str):
        raise TransportError(f"a rendezvous path must be a string, got {type(path).__name__}")
    base = os.path.basename(path)
    if os.path.dirname(path) != shm_dir.rstrip("/") or not base.startswith(prefix) or base in (".", ".."):
        raise TransportError(
            f"rendezvous path {path!r} is not under this job's {os.path.join(shm_dir, prefix)}* (refused)"
        )
    _check_own_file(path, "the shared segment")
    return path


def b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def unb64(text: Any) -> bytes | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise TransportError(f"a rendezvous handle must be base64 text, got {type(text).__name__}")
    return base64.b64decode(text, validate=True)
