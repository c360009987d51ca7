"""docs/plugins.md's examples, the files of examples/snippets/ it includes: each complete example (one per kind) is
registered in process as a plugin module, used from a spec on the embedded model, and checked against a computation
written here; each utility example runs with a loaded model and checks its results."""

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
SNIPPETS = ROOT / "examples" / "snippets"
CHECKPOINT = ROOT / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny" / "model.safetensors"
pytestmark = pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
KINDS = ("task", "detector", "steering", "decoder", "metric")
TASK = {"kind": "repeated_tokens", "n": 3, "length": 6}


def included() -> list[str]:
    """The files of examples/snippets/ that docs/plugins.md includes (``--8<-- "examples/snippets/<name>.py..."``),
    by name, each included in a ```python block."""
    return re.findall(r'```python\n--8<-- "examples/snippets/(\w+)\.py(?::example)?"\n```', DOC.read_text())


def blocks() -> dict[str, str]:
    """The complete examples, by kind: examples/snippets/<kind>.py."""
    return {k: (SNIPPETS / f"{k}.py").read_text() for k in KINDS if (SNIPPETS / f"{k}.py").is_file()}


@pytest.fixture
def plugin(request):
    """Register the doc's block for ``request.param`` as a plugin module; unregister afterwards."""
    module = types.ModuleType(f"docs_example_{request.param}")
    sys.modules[module.__name__] = module  # pydantic resolves the config's annotations there
    exec(compile(blocks()[request.param], f"examples/snippets/{request.param}.py", "exec"), module.__dict__)  # noqa: S102
    name = headlab.register_plugin(module, name=f"docs-{request.param}", replace=True)
    yield module
    headlab.unregister_plugin(name)
    sys.modules.pop(module.__name__)


def run(steps: list[dict], tmp_path: Path, task: dict | None = None) -> headlab.Run:
    return headlab.run({"name": "docs", "model": "headlab-tiny", "task": task or TASK, "steps": steps},
                       out=tmp_path / "runs")


def test_every_kind_has_one_complete_example_in_the_page():
    assert set(blocks()) == set(KINDS)
    assert [n for n in included() if n in KINDS] == list(KINDS)


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


# --------------------------------------------------------------------------- "Utilities for plugins"
UTILITIES = ("forward", "instrumented", "decoding", "anatomy", "component", "heads", "text")
PROMPTS = [("The key is 42. What is the key? It is", "42"), ("A cat sat on the mat. Where did the cat sit?", "mat")]


def utilities() -> dict[str, str]:
    """The utility examples, by name: examples/snippets/utility_<name>.py."""
    return {n: (SNIPPETS / f"utility_{n}.py").read_text() for n in UTILITIES
            if (SNIPPETS / f"utility_{n}.py").is_file()}


@pytest.fixture(scope="module")
def utility_run():
    """Run every utility block with ``lm`` (headlab-tiny) and ``examples``; name -> the block's namespace."""
    lm = load_model(ModelSpec(id="headlab-tiny", device="cpu"))
    examples = [headlab.Example(prompt=p, target=t) for p, t in PROMPTS]
    out = {}
    for name, code in utilities().items():
        module = types.ModuleType(f"docs_utility_{name}")
        sys.modules[module.__name__] = module  # pydantic resolves a config's annotations there
        module.__dict__.update(lm=lm, examples=examples)
        exec(compile(code, f"examples/snippets/utility_{name}.py", "exec"), module.__dict__)  # noqa: S102
        out[name] = module.__dict__
    yield lm, examples, out
    for name in out:
        sys.modules.pop(f"docs_utility_{name}")


def test_every_utility_has_an_example_in_the_page():
    assert tuple(utilities()) == UTILITIES
    assert [n for n in included() if n not in KINDS] == [f"utility_{n}" for n in UTILITIES]
    assert sorted(p.stem for p in SNIPPETS.glob("*.py")) == sorted(included())  # no file the page leaves out


def test_forward_and_instrumented_examples_agree_with_a_plain_forward(utility_run):
    lm, examples, ns = utility_run
    batch = headlab.tokenize(lm, examples)
    with torch.no_grad():
        logits = lm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=headlab.positions_from_mask(batch.attention_mask)).logits
    assert torch.equal(ns["forward"]["next_token"], logits[:, -1].argmax(-1))
    top_key = ns["forward"]["top_key"]
    assert top_key.dims == ("example", "layer", "head", "query")
    assert top_key.shape[:3] == (len(examples), lm.geometry.n_layers, lm.geometry.n_heads)
    np.testing.assert_array_equal(ns["instrumented"]["top_key_again"].values, top_key.values)
    last = top_key.isel(query=-1).values                     # a key at or before the query: causal
    assert (last >= 0).all() and (last <= batch.length - 1).all()


def test_decoding_example_is_a_penalised_greedy_loop(utility_run):
    """The example's decoder (batched, KV cache) == a loop without cache over each prompt alone that applies
    the penalty by hand; penalty 1 is greedy decoding."""
    lm, examples, ns = utility_run

    def by_hand(example: headlab.Example, penalty: float, steps: int) -> list[int]:
        ids = headlab.tokenize(lm, [example]).input_ids[0].tolist()
        out: list[int] = []
        for _ in range(steps):
            with torch.no_grad():
                logits = lm.model(input_ids=torch.tensor([ids + out])).logits[0, -1].float()
            seen = torch.tensor(sorted(set(ids + out)))
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
            token = int(logits.argmax())
            if token in lm.eos_ids:
                break
            out.append(token)
        return out

    assert ns["decoding"]["decoded"].tokens == [by_hand(ex, 1.3, 5) for ex in examples]
    plain = ns["decoding"]["decode"](ns["decoding"]["PenalisedGreedy"](penalty=1.0),
                                     headlab.generation.DecodeRequest(lm, headlab.tokenize(lm, examples), 5))
    assert plain.tokens == [by_hand(ex, 1.0, 5) for ex in examples]
    assert plain.tokens != ns["decoding"]["decoded"].tokens  # the penalty changes something here


def test_anatomy_example_is_each_heads_ov_norm(utility_run):
    lm, _, ns = utility_run
    attn = lm.attention_module(0)
    geo = lm.geometry
    d = geo.head_dim
    W_V = attn.v_proj.weight.T.reshape(-1, geo.n_kv_heads, d)             # (d_model, kv_head, d_head)
    W_O = attn.o_proj.weight.T.reshape(geo.n_heads, d, -1)                 # (head, d_head, d_model)
    group = geo.n_heads // geo.n_kv_heads
    expected = torch.stack([torch.linalg.matrix_norm(W_V[:, h // group] @ W_O[h]) for h in range(geo.n_heads)])
    torch.testing.assert_close(ns["anatomy"]["ov_norm"], expected, rtol=1e-4, atol=1e-4)


def test_component_example_is_rouge1_recall(utility_run):
    from headlab.text import rouge1

    _, examples, ns = utility_run
    expected = [rouge1(ex.target, f"it is {ex.target}", stemmer=True)[1] for ex in examples]
    assert list(ns["component"]["values"]) == expected == [1.0, 1.0]


def test_heads_example(utility_run):
    lm, _, ns = utility_run
    top, controls, score = ns["heads"]["top"], ns["heads"]["controls"], ns["heads"]["score"]
    assert score.dims == ("layer", "head") and len(controls) == len(top) == 2
    assert not set(top) & set(controls)
    assert float(score.sel(layer=top[0][0], head=top[0][1])) == float(score.max())
    assert sorted((int(layer), h) for layer, heads in ns["heads"]["pasta"].items() for h in heads) == sorted(top)


def test_text_example(utility_run):
    _, _, ns = utility_run
    assert ns["text"]["recall"] == 1.0 and ns["text"]["precision"] == pytest.approx(4 / 6)
