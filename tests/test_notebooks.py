"""Every example notebook runs top to bottom on the embedded model (nbclient, a real Jupyter kernel).

The notebooks check their own claims with asserts (a plugin's scores against eager attention, a
causal check's effect, ...), so a notebook that runs is a notebook whose numbers held.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def embedded_model_available() -> bool:
    from headlab.plugin_manager import get_manager

    return "headlab-tiny" in get_manager().components["models"]


def test_every_notebook_is_listed_and_clean():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "writing_a_plugin.ipynb", "retrieval_heads.ipynb", "pasta_steering.ipynb",
            "decoding.ipynb", "evaluation.ipynb", "circuits.ipynb"} <= names
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(not c.get("outputs") and c.get("execution_count") is None for c in code), \
            f"{path.name}: commit notebooks without outputs"
        text = "\n".join(c.source for c in nb.cells)
        assert "http://" not in text.replace("http://localhost", "") and "https://" not in text, \
            f"{path.name}: notebooks must not fetch anything"


#: the notebook the default set runs; the others run in the slow set (each is a kernel and a model of its own,
#: about 20-40 s of CPU; their features are tested in the default set without a kernel)
DEFAULT_NOTEBOOK = "quickstart"


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=() if p.stem == DEFAULT_NOTEBOOK else pytest.mark.slow)
                                  for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if not embedded_model_available() and not os.environ.get("HEADLAB_NOTEBOOK_MODEL"):
        pytest.skip("the embedded model headlab-tiny is not in this checkout yet")
    monkeypatch.setenv("HEADLAB_NOTEBOOK_OUT", str(tmp_path / "runs"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:  # show the failing cell's error, not the whole notebook
        pytest.fail(f"{path.name}: {str(e)[-3000:]}")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    # every widget the notebook displays was serialised for the front end
    views = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert views, f"{path.name} displays no widget"
    assert (tmp_path / "runs").is_dir() and any((tmp_path / "runs").iterdir())
