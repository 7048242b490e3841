"""The example notebooks run top to bottom (CPU)."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.ipynb")))
def test_notebook_runs(name, tmp_path):
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


def test_there_are_notebooks():
    assert len(list(EXAMPLES.glob("*.ipynb"))) >= 2
