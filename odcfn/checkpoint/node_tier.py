"""The memory tier of a job on several nodes: each node keeps its own ranks' files and its neighbour's.

/dev/shm is per node, so one node's snapshot files die with that node. Here node n's memory
tier (``MemoryTier(out_dir, node=n)``) holds the files of node n's writer ranks and a copy of
node n-1's (mod N); a node that lost its memory (rebooted, replaced) reads its files back from
node n+1, and a job falls back to the disk tier only when two adjacent nodes are gone.

Save (every ``checkpoint.memory_every`` steps, in the background like the single-node tier):

1. every writer rank writes its file into its node's staging directory, as a disk save does;
2. the node leader (local rank 0) waits for its node's files, sends them to node n+1's leader
   (``neighbour.send_files``: authenticated headers, raw bytes), waits for node n-1's files in its
   inbox, moves them in and commits the node's *part*: a manifest like a whole checkpoint's (the
   same tree, units, mesh and extra) whose file entries carry a sha256 only for the files the
   node holds, plus ``part = {node, nodes, held}``;
3. the leader verifies the part and points ``CURRENT`` at it (``MemoryTier.publish``).

No global barrier: a node commits once its own files and its neighbour's are in.

Restart (``resume``: every rank, once, before the state is built):

1. each node leader verifies the files of its committed parts;
2. two all-reduces of integers tell every rank which node holds which verified file of which
   step, and the mesh each step was saved by;
3. the newest step saved by this mesh whose files are all held somewhere wins, unless the disk
   tier's newest verified checkpoint is newer;
4. each node gets the files its ranks read (their own shards; under hybrid sharding every node
   reads node 0's) that it lacks, from the lowest node holding them, together with that node's
   manifest, and commits its part of that step; then every rank loads from its node's part.

A restart on another mesh (world size, ranks per node, sharding) resumes from the disk tier:
which node would hold which file is a property of the mesh that saved.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from odcfn.checkpoint import sharded
from odcfn.checkpoint.commit import CheckpointError, Staging, fsync_path, list_quietly
from odcfn.checkpoint.memory_tier import MemoryTier, committed, held, newest_verified, remove_stale
from odcfn.checkpoint.neighbour import Inbox, advertised_host, exchange_addresses, recv_dir, send_files
from odcfn.checkpoint.skeleton import nodes
from odcfn.checkpoint.verify import rank_file, sha256
from odcfn.transport.base import world_group
from odcfn.transport.rdzv import SECRET_ENV

__all__ = ["NodeTier"]

_KEEP = 4  # parts a node reports at a restart (it keeps two: CURRENT's and the one before)
_FIELDS = 6  # per reported part: step + 1, world size, ranks per node, hybrid, shard count, replicated


class NodeTier:
    """One rank's view of the memory tier of a job on ``mesh.num_nodes`` > 1 nodes."""

    def __init__(
        self, out_dir: str | os.PathLike, mesh: Any, collectives: Any, *, timeout: float = 60.0
    ) -> None:
        """A collective (every rank, at start-up): the node leaders open their inboxes and
        every rank learns where they listen. Needs ``ODCFN_JOB_SECRET`` (the same on every node:
        it authenticates the neighbour copies; ``odcfn launch`` sets one per job)."""
        if mesh.num_nodes < 2:
            raise ValueError(f"NodeTier is for jobs on several nodes; {mesh} is on one (use MemoryTier)")
        secret = os.environ.get(SECRET_ENV, "")
        try:
            self.secret = bytes.fromhex(secret)
        except ValueError:
            self.secret = b""
        if len(self.secret) < 16:
            raise ValueError(
                f"checkpoint.memory_every on {mesh.num_nodes} nodes needs {SECRET_ENV} set to the same hex "
                "secret (at least 32 hex digits) on every node: it authenticates the snapshot files nodes "
                "send each other (python -c 'import secrets; print(secrets.token_hex(32))')"
            )
        self.mesh, self.collectives, self.timeout = mesh, collectives, float(timeout)
        self.node, self.nodes, self.size = mesh.node, mesh.num_nodes, mesh.node_size
        self.tier = MemoryTier(out_dir, node=self.node)
        self.root = self.tier.root
        self.run = self.root.name.rsplit("-node", 1)[0]  # the same on every node of the run
        self.leader = mesh.local_rank == 0
        self.writers = mesh.with_rank(0).shard_group  # whose files make a snapshot, in shard order
        self.fetched: dict[str, Any] | None = None  # what resume read back from other nodes
        self.inbox = (
            Inbox(self.root, self.secret, self.run, self.node, advertised_host()) if self.leader else None
        )
        self.addresses = exchange_addresses(collectives, mesh, self.inbox.address if self.inbox else None)

    # --- which files live where --------------------------------------------------------------
    def own(self, node: int) -> list[int]:
        """The writer ranks on ``node`` (their files are that node's own)."""
        return [r for r in self.writers if r // self.size == node]

    def need(self, node: int, replicated: bool) -> set[int]:
        """The files the ranks of ``node`` read to resume on the mesh that saved them."""
        out = {
            self.writers[self.mesh.with_rank(r).shard_index]
            for r in range(node * self.size, (node + 1) * self.size)
        }
        return out | ({self.writers[0]} if replicated else set())

    def path(self, step: int) -> Path:
        return self.tier.path(step)

    # --- save ----------------------------------------------------------------------------------
    def write(
        self,
        path: str | os.PathLike,
        params: Any,
        opt_state: Any,
        step: int,
        *,
        model: Any,
        mesh: Any,
        extra: Any = None,
        timeout: float = 60.0,
        overwrite: bool = False,
        feedback: Any = None,
    ) -> Path:
        """This rank's share of the node's part of the snapshot of ``step`` at ``path`` (the
        writer ``AsyncSaver.save`` runs in the background); returns once the part is committed.
        ``feedback``: this rank's error-feedback residuals (``sharded.Feedback``), in its file."""
        root = Path(path)
        ranks = range(self.node * self.size, (self.node + 1) * self.size)
        stage = Staging(root, sharded.attempt_id(root, mesh.rank, step), mesh.rank, timeout, ranks)
        try:
            layout, skeleton, writers = sharded.write_rank_file(
                stage, params, opt_state, step, model=model, mesh=mesh, feedback=feedback
            )
            if not self.leader:
                sharded.wait_for_commit(stage, ranks[0], step)
                return root
            prev, nxt = (self.node - 1) % self.nodes, (self.node + 1) % self.nodes
            own, theirs = self.own(self.node), self.own(prev)
            sha = sharded.wait_for_files(stage, own, step)  # each writer hashed its own file
            if own:
                self._send(nxt, [(rank_file(r), stage.dir / rank_file(r)) for r in own], step, timeout, sha)
            if theirs:
                got = self.inbox.wait(step, [rank_file(r) for r in theirs], timeout, f"node {prev}")
                for name, header in got.items():  # its sha256 was checked on arrival
                    os.replace(recv_dir(self.root, step) / name, stage.dir / name)
                    sha[name] = header["sha256"]
            doc = sharded.manifest_for(
                model,
                mesh,
                layout,
                step,
                stage.attempt,
                skeleton,
                sharded.with_feedback(extra, feedback),
                stage.dir,
                writers,
                held=own + theirs,
                known=sha,
            )
            doc["part"] = {"node": self.node, "nodes": self.nodes, "held": sorted(own + theirs)}
            sharded.commit_manifest(stage, doc, step, overwrite)
        except BaseException as e:
            stage.abort(f"{type(e).__name__}: {e}")
            raise
        return root

    def _send(self, node: int, files: list[tuple[str, Path]], step: int, timeout: float, sha=None) -> None:
        send_files(
            self.addresses[node],
            files,
            step=step,
            to=node,
            run=self.run,
            secret=self.secret,
            timeout=timeout,
            sha=sha,
        )

    def publish(self, path: Path) -> None:
        """The node leader, after its part committed: verify it, point ``CURRENT`` at it, drop
        older parts and the inbox's leftovers up to its step."""
        self.tier.publish(path)
        step = int(path.name.removeprefix("step-"))
        for d in list_quietly(self.root, ".recv-*"):
            if d.name.removeprefix(".recv-").isdigit() and int(d.name.removeprefix(".recv-")) <= step:
                shutil.rmtree(d, ignore_errors=True)
        self.inbox.forget(step)

    # --- restart -------------------------------------------------------------------------------
    def _verified(self) -> dict[int, tuple[Path, dict, set[int], list[int]]]:
        """The leader's committed parts: step -> (dir, manifest, ranks whose files verify, the
        row it reports: step + 1 and the mesh that saved it)."""
        out = {}
        for step, d in committed(self.root)[:_KEEP]:
            try:
                doc = sharded.read_manifest(d)
                ok, keep = set(), held(doc) & set(self.writers)
                for e in doc["files"]:
                    if e.get("rank") not in keep:
                        continue
                    f = d / rank_file(e["rank"])
                    if f.is_file() and f.stat().st_size == e.get("bytes") and sha256(f) == e.get("sha256"):
                        ok.add(e["rank"])
                    else:
                        warnings.warn(
                            f"snapshot file {f} is missing or fails its sha256: read from a peer or skipped",
                            stacklevel=2,
                        )
                m = doc["mesh"]
                row = [
                    step + 1,
                    m["world_size"],
                    m["ranks_per_node"] or m["world_size"],
                    int(m["sharding"] == "hybrid"),
                    m["shard_count"],
                    int(_replicated(doc["tree"])),
                ]
                if not all(isinstance(x, int) and x >= 0 for x in row):
                    raise ValueError(f"its manifest's mesh is malformed: {m!r}")
                out[step] = (d, doc, ok, row)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                warnings.warn(f"skipping snapshot {d}: {e}", stacklevel=2)
        return out

    def _mesh_key(self) -> list[int]:
        m = self.mesh
        return [m.world_size, m.node_size, int(m.sharding == "hybrid"), m.shard_count]

    def resume(self, disk: Path) -> Path | None:
        """The checkpoint to resume from: this node's part of the newest complete snapshot of the
        memory tier (files fetched from peers as needed), or the disk tier's newest verified
        checkpoint if that is newer; None if there is neither. Every rank calls it, once."""
        mine = self._verified() if self.leader else {}
        W = self.mesh.world_size
        rows = torch.zeros(W, _KEEP, _FIELDS, dtype=torch.int64)
        for i, step in enumerate(sorted(mine, reverse=True)):
            rows[self.mesh.rank, i] = torch.tensor(mine[step][3])
        rows = self.collectives.all_reduce(world_group(self.mesh), rows).view(-1, _FIELDS).tolist()
        steps: dict[int, bool] = {}  # step saved by this mesh -> whether it has replicated tensors
        for r in rows:
            if r[0] and r[1:5] == self._mesh_key():
                steps[r[0] - 1] = steps.get(r[0] - 1, False) or bool(r[5])
        order = sorted(steps, reverse=True)
        avail = torch.zeros(max(len(order), 1), self.nodes, W, dtype=torch.int64)
        for ci, step in enumerate(order):
            for r in mine[step][2] if step in mine else ():
                avail[ci, self.node, r] = 1
        avail = self.collectives.all_reduce(world_group(self.mesh), avail) > 0
        chosen = None
        for ci, step in enumerate(order):
            needed = set().union(*(self.need(n, steps[step]) for n in range(self.nodes)))
            if all(bool(avail[ci, :, r].any()) for r in needed):
                chosen = (ci, step)
                break
        ck = newest_verified([disk], mesh=self.mesh, collectives=self.collectives)
        disk_step = None if ck is None else int(sharded.read_manifest(ck)["step"])
        if chosen is None or (disk_step is not None and disk_step > chosen[1]):
            return ck
        ci, step = chosen
        self._fetch(step, avail[ci], steps[step], mine)
        self.collectives.barrier()  # the leaders' parts are complete before any rank reads
        return self.path(step)

    def _fetch(self, step: int, avail: torch.Tensor, replicated: bool, mine: dict) -> None:
        """Every node gets the files of ``step`` its ranks read and lack (``avail``: node x rank)."""
        sends: dict[tuple[int, int], list[int]] = defaultdict(list)  # (from, to) -> ranks
        for n in range(self.nodes):
            for r in sorted(self.need(n, replicated)):
                if not avail[n, r]:
                    sends[(int(avail[:, r].nonzero()[0]), n)].append(r)
        if not self.leader:
            return
        for (src, dst), ranks in sorted(sends.items()):
            if src == self.node:
                d, doc = mine[step][:2]
                sha = {e["name"]: e["sha256"] for e in doc["files"] if e.get("sha256")}
                files = [(rank_file(r), d / rank_file(r)) for r in ranks]
                files.append((sharded.MANIFEST, d / sharded.MANIFEST))
                self._send(dst, files, step, self.timeout, sha)
        incoming = sorted(r for (_, dst), rs in sends.items() if dst == self.node for r in rs)
        if incoming:
            t0 = time.perf_counter()
            names = [rank_file(r) for r in incoming] + [sharded.MANIFEST]
            got = self.inbox.wait(step, names, self.timeout, f"the nodes holding ranks {incoming}' files")
            self._assemble(step, incoming, got, mine.get(step))
            self.tier.publish(self.path(step))
            sources = sorted({src for (src, dst) in sends if dst == self.node})
            size = sum(got[n]["bytes"] for n in names)
            took = time.perf_counter() - t0
            self.fetched = {
                "step": step,
                "ranks": incoming,
                "from_nodes": sources,
                "bytes": size,
                "seconds": took,
            }
            print(
                f"odcfn: snapshot of step {step}: node {self.node} read the files of ranks {incoming} "
                f"back from node(s) {sources} ({size / 2**20:.1f} MiB in {took:.2f}s)",
                file=sys.stderr,
                flush=True,
            )

    def _assemble(self, step: int, incoming: list[int], got: dict[str, dict], have: Any) -> None:
        """Commit this node's part of ``step`` with the files it kept and the ones it received."""
        recv = recv_dir(self.root, step)
        doc = json.loads((recv / sharded.MANIFEST).read_text())  # authenticated JSON; checked below
        if not isinstance(doc, dict) or doc.get("step") != step or not isinstance(doc.get("files"), list):
            raise CheckpointError(f"the manifest a peer sent for step {step} is not one of that step")
        keep = sorted(have[2]) if have is not None else []  # (dir, manifest, verified ranks, row)
        final = self.path(step)
        new = final.with_name(f".{final.name}.fetch-{os.getpid()}")
        shutil.rmtree(new, ignore_errors=True)
        new.mkdir(parents=True)
        entries = {}
        for r in keep:
            os.link(final / rank_file(r), new / rank_file(r))
            entries[r] = next(e for e in have[1]["files"] if e.get("rank") == r)
        for r in incoming:
            h, sent = got[rank_file(r)], next((e for e in doc["files"] if e.get("rank") == r), {})
            if sent.get("sha256") not in (None, h["sha256"]):
                raise CheckpointError(
                    f"a peer sent {rank_file(r)} of step {step} that its own manifest disowns"
                )
            os.replace(recv / rank_file(r), new / rank_file(r))
            entries[r] = {"name": rank_file(r), "rank": r, "sha256": h["sha256"], "bytes": h["bytes"]}
        doc["files"] = [
            entries.get(e.get("rank"), {**e, "sha256": None, "bytes": None}) for e in doc["files"]
        ]
        doc["part"] = {"node": self.node, "nodes": self.nodes, "held": sorted(entries)}
        (new / sharded.MANIFEST).write_text(json.dumps(doc, indent=1))
        fsync_path(new / sharded.MANIFEST)
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if final.exists():
            os.rename(final, old)
        os.rename(new, final)
        shutil.rmtree(old, ignore_errors=True)
        fsync_path(self.root)

    # --- life cycle ----------------------------------------------------------------------------
    def clear(self, newer_than: int) -> None:
        """The node leader, before the first step: drop parts past ``newer_than`` and every
        leftover of an interrupted save, fetch or delivery (no save of this job is in flight)."""
        remove_stale(self.root, newer_than)
        for pattern in (".recv-*", ".step-*.fetch-*", ".step-*.old-*"):
            for d in list_quietly(self.root, pattern):
                shutil.rmtree(d, ignore_errors=True)
        self.inbox.forget(1 << 62)

    def cleanup(self) -> None:
        """The node leader at the run's normal end: the tier's directory goes."""
        self.tier.cleanup()

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()


def _replicated(tree: dict) -> bool:
    """Whether the checkpoint holds tensors only rank 0's file has (every node then reads it)."""
    return any(n.get("type") == "tensor" for n in nodes(tree))
