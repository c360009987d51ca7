"""The example third-party package (examples/headlab-plugin-example) written only against headlab's public
API: its steering method and its decoding strategy, run from specs in this process (registered with
``headlab.register_plugin``), against references written here from the definitions: transformers' eager
attention with forward hooks on ``q_proj`` (a head's query scaled by 1 / temperature; with RoPE, scaling
before the rotation equals scaling after) and on the ``o_proj`` input (a head's output zeroed), decoded by
a plain loop without a KV cache, one prompt at a time (no padding).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
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
PACKAGE = ROOT / "examples" / "headlab-plugin-example" / "headlab_plugin_example"
CHECKPOINT = ROOT / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny" / "model.safetensors"
pytestmark = pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")

TEMPERATURE_HEADS = [(1, 5), (3, 1), (3, 6)]
CONTRAST_HEADS = [(3, 1), (2, 0)]
TASK = {"kind": "repeated_tokens", "n": 3, "length": 7}


@pytest.fixture(scope="module")
def example_plugin():
    spec = importlib.util.spec_from_file_location("headlab_plugin_example", PACKAGE / "__init__.py",
                                                  submodule_search_locations=[str(PACKAGE)])
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    name = headlab.register_plugin(module, name="example-in-process", replace=True)
    yield module
    headlab.unregister_plugin(name)
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def eager():
    lm = load_model(ModelSpec(id="headlab-tiny", device="cpu"))
    model = AutoModelForCausalLM.from_pretrained(lm.model.name_or_path, attn_implementation="eager").eval()
    return lm, model


@contextlib.contextmanager
def hooks(model, *, temperature: float | None = None, ablate: list[tuple[int, int]] = ()):
    """Scale the chosen heads' query slices by 1 / temperature; zero the ablated heads' output slices."""
    D = model.config.head_dim
    handles = []
    for layer in range(model.config.num_hidden_layers):
        attn = model.model.layers[layer].self_attn
        hot = [h for ly, h in TEMPERATURE_HEADS if ly == layer] if temperature else []
        off = [h for ly, h in ablate if ly == layer]
        if hot:
            def scale_q(mod, args, out, hot=hot):
                out = out.clone()
                for h in hot:
                    out[..., h * D:(h + 1) * D] /= temperature
                return out
            handles.append(attn.q_proj.register_forward_hook(scale_q))
        if off:
            def zero_z(mod, args, off=off):
                x = args[0].clone()
                for h in off:
                    x[..., h * D:(h + 1) * D] = 0
                return (x,)
            handles.append(attn.o_proj.register_forward_pre_hook(zero_z))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def logits_of(model, ids: list[int], **edits) -> torch.Tensor:
    with torch.no_grad(), hooks(model, **edits):
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def reference_generate(model, ids: list[int], steps: int, eos: int, *, temperature=None, beta=None) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        base = logits_of(model, ids + out, temperature=temperature)[-1]
        if beta is None:
            scores = base
        else:
            ablated = logits_of(model, ids + out, temperature=temperature, ablate=CONTRAST_HEADS)[-1]
            scores = (1 + beta) * base.log_softmax(-1) - beta * ablated.log_softmax(-1)
        nxt = int(scores.argmax())
        if nxt == eos:
            break
        out.append(nxt)
    return out


def run_spec(steps: list[dict], tmp_path: Path, task: dict | None = None) -> headlab.Run:
    return headlab.run({"name": "example", "model": "headlab-tiny", "task": task or TASK, "steps": steps},
                       out=tmp_path / "runs")


def test_the_example_registers_all_four_kinds(example_plugin):
    from headlab.plugin_manager import get_manager

    mgr = get_manager()
    for category, kind in [("detectors", "output_norm"), ("metrics", "word_count"),
                           ("steering", "head_temperature"), ("decoders", "head_contrast")]:
        assert mgr.get(category, kind).plugin == "example-in-process"
    assert mgr.get("decoders", "head_contrast").score is not None
    assert "head_temperature" in json.dumps(headlab.json_schema())


def test_head_temperature_and_head_contrast_generate_like_the_reference(example_plugin, eager, tmp_path):
    lm, model = eager
    steer = [{"kind": "head_temperature", "heads": [list(h) for h in TEMPERATURE_HEADS], "temperature": 0.5}]
    contrast = {"kind": "head_contrast", "heads": [list(h) for h in CONTRAST_HEADS], "beta": 0.8}
    run = run_spec([
        {"id": "steered", "generate": {"max_new_tokens": 6, "steer": steer, "batch_size": 2}},
        {"id": "contrast", "generate": {"max_new_tokens": 6, "decode": contrast, "batch_size": 2}},
        {"id": "both", "generate": {"max_new_tokens": 6, "steer": steer, "decode": contrast, "batch_size": 2}},
    ], tmp_path)
    examples = build_examples(headlab.load_spec({"model": "headlab-tiny", "task": TASK, "steps": [
        {"id": "x", "detect": {"kind": "previous_token"}}]}).spec.task, lm, seed=0)
    eos, tok = lm.eos_ids[0], lm.tokenizer
    cases = {"steered": dict(temperature=0.5), "contrast": dict(beta=0.8), "both": dict(temperature=0.5, beta=0.8)}
    for step, opts in cases.items():
        want = [tok.decode(reference_generate(model, list(ex.input_ids), 6, eos, **opts), skip_special_tokens=True)
                for ex in examples]
        assert list(run.results[step]["output"].values) == want, step
    plain = [tok.decode(reference_generate(model, list(ex.input_ids), 6, eos), skip_special_tokens=True)
             for ex in examples]
    assert plain != list(run.results["both"]["output"].values)  # the edits change what is generated


def test_head_contrast_scores_choices_like_the_reference(example_plugin, eager, tmp_path):
    lm, model = eager
    data = tmp_path / "mc.jsonl"
    rows = [{"q": "sara lives in paris . where does sara live ?", "a": " paris", "b": " rome .", "ans": 0},
            {"q": "the key is blue", "a": " blue", "b": " red green", "ans": 0}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"kind": "jsonl", "path": str(data), "prompt": "{{ q }}", "choices": ["{{ a }}", "{{ b }}"],
            "label": "ans"}
    steer = [{"kind": "head_temperature", "heads": [list(h) for h in TEMPERATURE_HEADS], "temperature": 2.0}]
    run = run_spec([{"id": "mc", "score": {"decode": {"kind": "head_contrast", "beta": 0.5,
                                                      "heads": [list(h) for h in CONTRAST_HEADS]},
                                           "steer": steer, "batch_size": 3}}], tmp_path, task)
    tok = lm.tokenizer
    got = run.results["mc"]["logprob"].values
    for i, r in enumerate(rows):
        for j, choice in enumerate((r["a"], r["b"])):
            full = tok(r["q"] + choice)["input_ids"]
            n = len(full) - len(tok(r["q"])["input_ids"])
            base = logits_of(model, full, temperature=2.0)[-n - 1:-1].log_softmax(-1)
            ablated = logits_of(model, full, temperature=2.0, ablate=CONTRAST_HEADS)[-n - 1:-1].log_softmax(-1)
            scores = 1.5 * base - 0.5 * ablated
            want = float(scores.gather(-1, torch.tensor(full[-n:])[:, None]).sum())
            np.testing.assert_allclose(got[i, j], want, atol=1e-4)
