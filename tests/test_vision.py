"""Images in specs on tiny random LLaVA and Qwen2-VL (built from configs, nothing downloaded).

Checked against independent computations: the processor's own token ids and image tokens, transformers'
own forward and ``generate`` on each example alone (the processor's inputs, the model's own positions,
Qwen2-VL's multimodal rotary positions included), and the naive float64 VHR of METHODS.md written with hooks
in tests/fixtures/vision.py.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import headlab
from headlab import instrument as ins
from headlab.generation import tokenize
from headlab.model import load_model
from headlab.plugins.steering import vhr as V
from headlab.spec import ModelSpec
from headlab.vision import placeholder

from fixtures import vision as F

NEW = 4


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def vlm(request):
    lm = load_model(ModelSpec(config=F.CONFIGS[request.param], device="cpu"))
    lm.model.generation_config.eos_token_id = None
    return lm


def reference(lm):
    """The same model on transformers' SDPA attention, in float64 (eager attention in float64 turns the
    padding positions of a left-padded batch into NaN that reach every position by the third layer)."""
    model = copy.deepcopy(lm.model)
    model.set_attn_implementation("sdpa")
    return model.double()


def alone(lm, ex):
    """The processor's inputs for one example by itself (what transformers' own pipeline feeds the model)."""
    text = ex.prompt.replace("<image>", placeholder(lm.processor))
    return lm.processor(text=[text], images=ex.images, return_tensors="pt")


def runs(ids, token):
    return V.token_runs(ids, token)


def test_image_tokens_are_the_processors(vlm):
    exs = F.examples(3)
    batch = tokenize(vlm, exs)
    own_token = vlm.processor.tokenizer.convert_tokens_to_ids(vlm.processor.image_token)
    assert vlm.image_token_id == own_token
    assert len(set(batch.pad)) > 1  # the batch is left-padded
    for r, ex in enumerate(exs):
        enc = alone(vlm, ex)
        own = enc["input_ids"][0].tolist()
        pad = batch.pad[r]
        assert batch.input_ids[r, pad:].tolist() == own
        assert batch.image_spans[r] == [(s + pad, e + pad) for s, e in runs(own, own_token)]
        assert batch.spans("image")[r] == batch.image_spans[r]
        (s, e), = batch.image_spans[r]
        rows, cols = batch.image_grids[r][0]
        if "image_grid_thw" in enc:  # Qwen2-VL: t*h*w patches merged 2x2
            t, h, w = enc["image_grid_thw"][0].tolist()
            assert (rows, cols) == (t * h // 2, w // 2)
        else:  # LLaVA: (image_size / patch_size)^2, the CLS token dropped
            assert (rows, cols) == (16 // 4, 16 // 4)
        assert rows * cols == e - s
        # the marker's characters map to the image's tokens (and Qwen2-VL's vision start/end around them)
        at = ex.prompt.index("<image>")
        a, b = batch.token_span(r, at, at + len("<image>"))
        assert (a, b) == ((s, e) if vlm.model.config.model_type == "llava" else (s - 1, e + 1))
        # text after the image keeps its character offsets
        word = ex.prompt.index("Answer")
        a, b = batch.token_span(r, word, word + len("Answer"))
        assert b == a + 1 and vlm.tokenizer.convert_ids_to_tokens(int(batch.input_ids[r, a])) == "Answer"


def test_batched_prefill_equals_each_example_alone(vlm):
    exs = F.examples(3)
    batch = tokenize(vlm, exs)
    with torch.no_grad():
        out = vlm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.positions(), **batch.forward_inputs()).logits
        for r, ex in enumerate(exs):
            ref = vlm.model(**alone(vlm, ex)).logits[0]
            real = batch.attention_mask[r].bool()
            torch.testing.assert_close(out[r][real], ref, atol=1e-5, rtol=0)


def test_greedy_generation_equals_transformers_generate(vlm):
    exs = F.examples(3)
    ours = headlab.generate(vlm, exs, max_new_tokens=NEW)
    for r, ex in enumerate(exs):
        enc = alone(vlm, ex)
        with torch.no_grad():
            ref = vlm.model.generate(**enc, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        assert ours.tokens[r] == ref[0, enc["input_ids"].shape[1]:].tolist()


def hf_generate(model, batch, **kw):
    dtype = next(model.parameters()).dtype
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.forward_inputs().items()}
    with torch.no_grad():
        out = model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             **inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, batch.length:], torch.stack(out.logits, 1)


def spec(model_type: str) -> str:
    import json

    return (f"name: vhr-images\nmodel: {{config: {json.dumps(F.CONFIGS[model_type])}}}\n"
            "task: {kind: test_images, n: 3}\n"
            "steps:\n"
            "  - id: vhd\n    detect: {kind: segment_divergence, method: mask}\n"
            "  - id: vhd_remove\n    detect: {kind: segment_divergence}\n"
            f"  - id: g\n    generate: {{max_new_tokens: {NEW}, steer: [{{kind: vhr}}]}}\n")


@pytest.fixture
def image_task():
    name = headlab.register_plugin(F.TaskPlugin(), "test_images")
    yield
    headlab.unregister_plugin(name)


def test_vhr_from_a_spec_equals_the_python_api_and_the_naive_reference(vlm, image_task, tmp_path):
    model_type = vlm.model.config.model_type
    run = headlab.run(spec(model_type), out=tmp_path)
    exs = F.examples(3, seed=run.attrs.get("seed", 0))
    batch = tokenize(vlm, exs)
    segments = batch.spans("image")
    layers = range(vlm.geometry.n_layers)
    # the naive reference (float64, transformers' attention, hooks)
    vhd_ref: dict[int, np.ndarray] = {}
    ref_model = reference(vlm)
    with F.naive_vhr(ref_model, segments, layers, vhd_out=vhd_ref) as ref_selected:
        ref_tokens, ref_logits = hf_generate(ref_model, batch)
    # the plugin's mechanism on headlab's attention (float64 too), through transformers' generate
    ours = copy.deepcopy(vlm.model).double()
    plan = ins.Plan()
    state = V.add_vhr(plan, segments, None)
    with ins.instrument(ours, plan):
        tokens, logits = hf_generate(ours, batch)
    for layer in layers:
        assert np.array_equal(state.selected[layer].numpy(), ref_selected[layer]), layer
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    # the Python API and the spec generate the same tokens and store the same choice
    api = headlab.generate(vlm, exs, steer=[{"kind": "vhr"}], max_new_tokens=NEW)
    assert api.tokens == tokens.tolist()
    g = run.results["g"]
    assert [list(map(int, t[t >= 0])) for t in g["output_ids"].values] == api.tokens
    for layer in layers:
        assert np.array_equal(g["vhr_selected"].sel(layer=layer).values, ref_selected[layer]), layer
    assert not torch.equal(tokens, hf_generate(ours, batch)[0])  # reinforcement changed the generation
    # VHD (mask): at layer 0 every head's input is the embedding, so it equals the naive within-layer VHD
    vhd = run.results["vhd"]
    np.testing.assert_allclose(vhd["example_score"].sel(layer=0).values, vhd_ref[0], rtol=1e-4, atol=1e-6)
    assert vhd.attrs["span"] == "image"
    removed = run.results["vhd_remove"]["example_score"].values
    assert np.isfinite(removed).all() and (removed > 0).any()


def test_images_on_a_text_model_or_without_markers_are_clear_errors(image_task, tmp_path):
    tiny = load_model(ModelSpec(id="headlab-tiny", device="cpu"))
    with pytest.raises(ValueError, match="takes no images"):
        tokenize(tiny, F.examples(1))
    lm = load_model(ModelSpec(config=F.LLAVA, device="cpu"))
    bad = F.examples(1)[0]
    bad.prompt = bad.prompt.replace("<image>", "")
    with pytest.raises(ValueError, match=r"1 image\(s\) and 0 '<image>' marker"):
        tokenize(lm, [bad])
    with pytest.raises(headlab.StepError, match="takes no images"):
        headlab.run("name: t\ntask: {kind: test_images, n: 1}\nsteps:\n  - id: g\n    generate: {}\n",
                    out=tmp_path)
