"""The example notebooks run top to bottom (CPU), and are committed with the outputs of such a run."""

import tempfile
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(p.name for p in EXAMPLES.glob("*.ipynb"))


def _outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_saved_with_the_outputs_of_a_clean_run(name):
    """Every code cell shows what it printed, none an error or a traceback, and no output names this machine's
    paths (the notebooks print file names only)."""
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("outputs") for c in code), "a code cell was saved without outputs: re-run and save"
    outputs = _outputs(nb)
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert not [o for o in outputs if o.get("name") == "stderr"], "warnings in the saved outputs"
    text = "".join(str(o.get("text", "")) + str(o.get("data", "")) for o in outputs)
    for path in {str(EXAMPLES.parent), tempfile.gettempdir() + "/", str(Path.home()) + "/"}:
        assert path not in text, f"a machine-specific path ({path}) in the saved outputs"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path):
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert not [o for o in _outputs(nb) if o.get("output_type") == "error"]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2
