"""The tree stays `ruff check` clean (the style rules live in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path


def test_ruff_check_is_clean():
    root = Path(__file__).parent.parent
    ruff = shutil.which("ruff") or (Path(sys.executable).parent / "ruff")
    assert Path(ruff).exists(), "ruff is a test requirement (the dev extra): pip install -e '.[dev,gpu]'"
    proc = subprocess.run([str(ruff), "check", str(root)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
