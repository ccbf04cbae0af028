"""bench/gpu_check.sh and bench/gpu_check.py on this CPU machine: the dry run passes and its JSON
holds every section in the order of value; one failing or hanging section does not hide the
next; the device branch installs carried wheels into a target dir only (a fake nvidia-smi and a
hand-made wheel stand in for the GPU machine, whose torch then sees no GPU and skips)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.transport import gpu_check_fakes as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check as G  # noqa: E402
import gpu_check_paths as P  # noqa: E402
from gpu_check_ranks import PhaseError, Ranks  # noqa: E402

PATH_NAMES = ["path_ipc_one_gpu", "path_ipc_across_gpus", "path_nvshmem_init", "path_nvshmem_put_signal",
              "path_fused_head"]


def test_sections_run_in_order_of_value():
    names = G.section_names([2, 4])
    assert names == [
        "env", *PATH_NAMES, "kernels", "fused_head", "ipc_w2_grads", "ipc_w2_bandwidth", "kernel_bandwidth",
        "ipc_w4_grads", "ipc_w4_bandwidth", "nvshmem_w1_kernels", "nvshmem_w2_transport",
    ]  # fmt: skip


def test_a_failing_section_does_not_hide_the_next(tmp_path):
    path = tmp_path / "r.json"
    rep = G.Report(str(path), ["a", "b", "c", "d", "e", "f"], budget=1000)

    def crash():
        raise KeyError("boom")

    def hang():
        raise PhaseError("phase 'grads': ranks [1] gave no answer within 5 s")

    def rank_raised():
        raise PhaseError("phase 'grads': rank 0 failed:\nTraceback ...\nRuntimeError: no IPC")

    rep.run("a", crash)
    rep.run("b", hang)
    rep.run("c", rank_raised)
    rep.run("d", lambda: ("pass", "fine", {"x": 1}))
    rep.budget = 0  # spent: later sections are skipped, and say why
    rep.run("e", lambda: ("pass", "never", {}))
    doc = json.loads(path.read_text())
    s = doc["sections"]
    assert list(s) == ["a", "b", "c", "d", "e", "f"]
    assert s["a"]["status"] == "error" and "KeyError: 'boom'" in s["a"]["error"]
    assert s["b"]["status"] == "timeout" and "gave no answer" in s["b"]["error"]
    assert s["c"]["status"] == "error" and "RuntimeError: no IPC" in s["c"]["error"]
    assert s["d"]["status"] == "pass" and s["d"]["x"] == 1 and s["d"]["error"] is None
    assert s["e"]["status"] == "skip" and "budget" in s["e"]["detail"]
    assert s["f"]["status"] == "skip" and s["f"]["detail"] == "not reached"


def test_rank_groups_report_a_failed_rank_and_time_out_a_silent_one():
    group = Ranks(F.rank_1_raises, 2)
    try:
        with pytest.raises(PhaseError, match=r"rank 1 failed:(.|\n)*ValueError: planted"):
            group.collect("grads", 120)
    finally:
        group.close()
    group = Ranks(F.silent, 2)
    t0 = time.monotonic()
    try:
        with pytest.raises(PhaseError, match=r"ranks \[0, 1\] gave no answer within 3 s"):
            group.collect("grads", 3)
    finally:
        group.close(grace=1)  # kills what still runs, in bounded time
    assert time.monotonic() - t0 < 60
    assert not any(p.is_alive() for p in group.procs)


def _never(dev):
    return "needs 2 GPUs, 1 visible"


def test_paths_report_each_path_on_its_own(tmp_path):
    # deadlines are seconds after a group started; generous where an answer comes (spawning
    # processes on a loaded 2-core machine is slow), short where none does
    none = (lambda d: None)
    paths = {
        "hangs": P.Path(F.phases_then_hang, 1, lambda d: (),
                        (("init", "p_init", 120.0), ("put_signal", "p_put", 30.0),
                         ("after", "p_after", 99.0)), none),
        "raises": P.Path(F.raises, 1, lambda d: (), (("ipc", "p_raises", 120.0),), none),
        "skips": P.Path(F.fine, 2, lambda d: (), (("ipc", "p_skips", 120.0),), _never),
        "wrong": P.Path(F.wrong, 1, lambda d: (), (("head", "p_wrong", 120.0),), none),
        "fine": P.Path(F.fine, 2, lambda d: (), (("ipc", "p_fine", 120.0),), none),
    }
    names = P.section_names(paths)
    rep = G.Report(str(tmp_path / "r.json"), names, budget=1000)
    t0 = time.monotonic()
    P.run_paths(rep, G.torch.device("cpu"), paths)
    assert time.monotonic() - t0 < 120  # the hang costs its own timeout, not the others'
    s = json.loads((tmp_path / "r.json").read_text())["sections"]
    assert list(s) == names
    assert s["p_init"]["status"] == "pass"
    assert s["p_put"]["status"] == "fail" and s["p_put"]["detail"].startswith("hung: no answer 30 s after")
    assert "killed" in s["p_put"]["detail"]
    assert s["p_after"]["status"] == "skip" and "p_put hung" in s["p_after"]["detail"]
    assert s["p_raises"]["status"] == "fail"
    assert "RuntimeError: cudaIpcOpenMemHandle: invalid device context" in s["p_raises"]["detail"]
    assert "Traceback" in s["p_raises"]["error"]
    assert s["p_skips"] == {"status": "skip", "detail": "needs 2 GPUs, 1 visible", "error": None}
    assert s["p_wrong"]["status"] == "fail" and "wrong result: fp32" in s["p_wrong"]["detail"]
    assert s["p_fine"]["status"] == "pass" and "cpu:0" in s["p_fine"]["detail"]
    assert P.blocked(rep, "p_fine", "p_wrong").startswith("p_wrong failed")
    assert P.blocked(rep, "p_fine", "p_skips") is None  # a skipped path blocks nothing


def test_paths_without_cuda_skip_with_the_reason(monkeypatch):
    cpu = G.torch.device("cpu")
    assert P._needs_two_gpus(cpu) == P._needs_nvshmem(cpu) == "needs CUDA (this run is on cpu)"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in P._triton_ok(cpu)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    return env | {"PYTHON": sys.executable}


def test_cpu_dry_run_passes_and_writes_every_section(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu", "--world", "2"],
        env=_env() | {"OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "gpu_check.log").read_text()
    assert "=== gpu_check summary" in log and "gpu_check: exit 0" in log
    s = json.loads((out / "gpu_check.json").read_text())["sections"]
    assert list(s) == G.section_names([2])
    for name in ("env", "path_ipc_one_gpu", "path_fused_head", "kernels", "fused_head", "ipc_w2_grads",
                 "ipc_w2_bandwidth", "kernel_bandwidth"):
        assert s[name]["status"] == "pass", (name, s[name])
    for name in ("path_ipc_across_gpus", "path_nvshmem_init", "path_nvshmem_put_signal"):
        assert s[name]["status"] == "skip" and "needs CUDA" in s[name]["detail"], (name, s[name])
    for name in ("nvshmem_w1_kernels", "nvshmem_w2_transport"):
        assert s[name]["status"] == "skip" and "needs CUDA" in s[name]["detail"]
    grads = s["ipc_w2_grads"]
    assert grads["worst_err"] < 1e-4 and grads["syncs"] == [1]
    rows = grads["ranks"]["0"]
    assert set(rows) == {
        f"{m}/{c}" for m in ("remote_add", "landing") for c in ("odc", "collective", "odc_vs_collective")
    }
    assert set(s["ipc_w2_bandwidth"]["modes"]) == {"remote_add", "landing"}


def _wheel(where: Path) -> Path:
    """A minimal pure-Python wheel (one module), written by hand: no build backend needed."""
    name = "odcfn_probe_pkg-1.0-py3-none-any.whl"
    dist = "odcfn_probe_pkg-1.0.dist-info"
    with zipfile.ZipFile(where / name, "w") as z:
        z.writestr("odcfn_probe_pkg.py", "ANSWER = 42\n")
        z.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: odcfn-probe-pkg\nVersion: 1.0\n")
        z.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{dist}/RECORD", "")
    return where / name


def test_device_branch_installs_carried_wheels_into_a_target_dir(tmp_path):
    bin_dir, wheels, site, out = (tmp_path / d for d in ("bin", "wheels", "site", "out"))
    for d in (bin_dir, wheels):
        d.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (fake, for the test)'\n")
    fake.chmod(0o755)
    _wheel(wheels)
    env = _env() | {
        "OUT": str(out),
        "GPU_WHEELS": str(wheels),
        "GPU_SITE": str(site),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (site / "odcfn_probe_pkg.py").exists()  # installed into the target dir, nowhere else
    log = (out / "gpu_check.log").read_text()
    assert "GPU 0: NVIDIA H200 (fake" in log
    assert f"odcfn from {ROOT / 'odcfn'}" in log  # the checkout's odcfn, through PYTHONPATH
    assert "no CUDA GPU visible to torch" in log  # this torch is a CPU build: the check skips
