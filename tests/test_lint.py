"""The tree stays `ruff check` clean (the style rules live in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def test_ruff_check_is_clean():
    root = Path(__file__).parent.parent
    ruff = shutil.which("ruff") or (Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (it comes with the dev extra)")
    proc = subprocess.run([str(ruff), "check", str(root)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
