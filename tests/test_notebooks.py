"""The example notebooks: committed without outputs, and every cell runs green."""

from __future__ import annotations

import subprocess
from pathlib import Path

import ipykernel  # noqa: F401  (the kernel nbclient starts)
import nbclient
import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def test_the_example_notebooks_exist():
    names = {p.stem for p in NOTEBOOKS}
    want = {"quickstart", "load_imbalance", "gradient_equivalence", "grpo", "preference", "moe", "staleness"}
    assert want <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_are_stripped(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; strip them before committing"


def _untracked() -> str:
    """What git sees in examples/ beyond the committed files (ignored files aside)."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", str(EXAMPLES)],
                          cwd=EXAMPLES, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    """Run where Jupyter runs it (beside itself), and leave the checkout as it was found (issue 40,
    item 15: the MoE notebook left examples/moe_trace.json behind)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    )
    before = _untracked()
    client.execute()  # raises CellExecutionError naming the cell on the first failure
    assert _untracked() == before, f"{path.name} left files in the checkout"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert printed.strip(), f"{path.name} printed nothing"
