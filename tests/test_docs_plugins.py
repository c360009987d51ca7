"""docs/plugins.md's complete examples, one per kind: each block is run as a plugin module registered in
process, used from a spec on the embedded model, and checked against a computation written here."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import headlab
from headlab.model import load_model
from headlab.runner import build_examples
from headlab.spec import ModelSpec

ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "plugins.md"
CHECKPOINT = ROOT / "plugins" / "models" / "tiny" / "headlab-tiny" / "model.safetensors"
pytestmark = pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
KINDS = ("task", "detector", "steering", "decoder", "metric")
TASK = {"kind": "repeated_tokens", "n": 3, "length": 6}


def blocks() -> dict[str, str]:
    """The ```python blocks of docs/plugins.md that start with ``# complete example: <kind>``."""
    found = re.findall(r"```python\n# complete example: (\w+)\n(.*?)```", DOC.read_text(), flags=re.S)
    return dict(found)


@pytest.fixture
def plugin(request):
    """Register the doc's block for ``request.param`` as a plugin module; unregister afterwards."""
    module = types.ModuleType(f"docs_example_{request.param}")
    sys.modules[module.__name__] = module  # pydantic resolves the config's annotations there
    exec(compile(blocks()[request.param], f"docs/plugins.md ({request.param})", "exec"), module.__dict__)  # noqa: S102
    name = headlab.register_plugin(module, name=f"docs-{request.param}", replace=True)
    yield module
    headlab.unregister_plugin(name)
    sys.modules.pop(module.__name__)


def run(steps: list[dict], tmp_path: Path, task: dict | None = None) -> headlab.Run:
    return headlab.run({"name": "docs", "model": "headlab-tiny", "task": task or TASK, "steps": steps},
                       out=tmp_path / "runs")


def test_every_kind_has_one_complete_example():
    assert set(blocks()) == set(KINDS)


@pytest.mark.parametrize("plugin", ["task"], indirect=True)
def test_task_example(plugin, tmp_path):
    result = run([{"id": "p", "detect": {"kind": "previous_token"}}], tmp_path,
                 task={"kind": "copy_first", "n": 4, "length": 7})
    ids = result.results["p"]["input_ids"].values
    assert ids.shape == (4, 8)
    assert (ids[:, -1] == ids[:, 0]).all() and (ids >= 4).all()


@pytest.mark.parametrize("plugin", ["detector"], indirect=True)
def test_detector_example_matches_eager_attention(plugin, tmp_path):
    got = run([{"id": "self", "detect": {"kind": "self_mass"}}], tmp_path).results["self"]["score"].values
    lm = load_model(ModelSpec(id="headlab-tiny", device="cpu"))
    eager = AutoModelForCausalLM.from_pretrained(lm.model.name_or_path, attn_implementation="eager").eval()
    diag = []
    for ex in build_examples(headlab.load_spec({"task": TASK, "steps": [
            {"id": "x", "detect": {"kind": "previous_token"}}]}).spec.task, lm, seed=0):
        with torch.no_grad():
            attn = torch.stack(eager(input_ids=torch.tensor([ex.input_ids]), output_attentions=True).attentions)
        diag.append(attn[:, 0].diagonal(dim1=-2, dim2=-1).mean(-1).numpy())
    np.testing.assert_allclose(got, np.mean(diag, 0), atol=1e-5)


@pytest.mark.parametrize("plugin", ["steering"], indirect=True)
def test_steering_example(plugin, tmp_path):
    heads = [[3, 1], [3, 6], [2, 0]]
    result = run([
        {"id": "plain", "generate": {"max_new_tokens": 6}},
        {"id": "one", "generate": {"max_new_tokens": 6, "steer": [
            {"kind": "head_temperature", "heads": heads, "temperature": 1.0}]}},
        {"id": "hot", "generate": {"max_new_tokens": 6, "steer": [
            {"kind": "head_temperature", "heads": heads, "temperature": 0.05}]}},
    ], tmp_path).results
    plain = list(result["plain"]["output"].values)
    assert list(result["one"]["output"].values) == plain  # temperature 1 changes nothing
    assert list(result["hot"]["output"].values) != plain


@pytest.mark.parametrize("plugin", ["decoder"], indirect=True)
def test_decoder_example(plugin, tmp_path):
    result = run([
        {"id": "greedy", "generate": {"max_new_tokens": 5}},
        {"id": "top_only", "generate": {"max_new_tokens": 5, "decode": {"kind": "min_p", "min_p": 1.0}}},
        {"id": "sampled", "generate": {"max_new_tokens": 5, "decode": {"kind": "min_p", "min_p": 0.01}}},
    ], tmp_path).results
    # min_p = 1 keeps only the most likely token: greedy decoding
    assert list(result["top_only"]["output"].values) == list(result["greedy"]["output"].values)
    kept = result["top_only"]["kept"].values
    assert np.nanmax(kept) == 1 and np.nanmax(result["sampled"]["kept"].values) > 1


@pytest.mark.parametrize("plugin", ["metric"], indirect=True)
def test_metric_example(plugin, tmp_path):
    ds = run([{"id": "g", "generate": {"max_new_tokens": 4, "metrics": ["characters"]}}], tmp_path).results["g"]
    assert ds["characters"].values.tolist() == [float(len(o)) for o in ds["output"].values]
