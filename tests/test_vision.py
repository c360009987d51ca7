"""Images in specs on tiny random LLaVA and Qwen2-VL (built from configs, nothing downloaded).

Checked against independent computations: the processor's own token ids and image tokens, transformers'
own forward and ``generate`` on each example alone (the processor's inputs, the model's own positions,
Qwen2-VL's multimodal rotary positions included), and the naive float64 VHR of docs/methods.md#vhr written with hooks
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
    # every array names its dims from the vocabulary; the report draws the stored image attention
    from headlab.dims import unknown_dims
    from headlab.report import render_report

    for step in ("vhd", "vhd_remove", "g"):
        assert unknown_dims(run.results[step]) == [], step
    att = vhd["preview_attention"]
    assert att.dims == ("layer", "head", "patch_row", "patch_col")
    assert att.shape[2] * att.shape[3] == batch.image_spans[0][0][1] - batch.image_spans[0][0][0]
    assert 'class="image-attention"' in render_report(run)


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


def test_scores_of_continuations_after_images_equal_transformers(vlm):
    exs = F.examples(3)
    conts = [" yes", " red circle", " no"]
    ours = headlab.logprobs(vlm, exs, conts)
    for r, (ex, cont) in enumerate(zip(exs, conts, strict=True)):
        full = alone(vlm, type(ex)(prompt=ex.prompt + cont, images=ex.images))
        n = len(vlm.tokenizer(ex.prompt + cont)["input_ids"]) - len(vlm.tokenizer(ex.prompt)["input_ids"])
        ids = full["input_ids"][0]
        with torch.no_grad():
            logp = vlm.model(**full).logits[0].double().log_softmax(-1)
        want = [float(logp[i - 1, ids[i]]) for i in range(len(ids) - n, len(ids))]
        np.testing.assert_allclose(ours.tokens[r], want, atol=2e-5)


def naive_decore(lm, ex, heads, alpha, n_new):
    """DeCoRe by recomputing the whole sequence at every step (no KV cache), the masked model made by zeroing
    the heads' slices of the ``o_proj`` input (docs/methods.md#head-masking-and-scaling: ``mask: output``)."""
    H = lm.geometry.n_heads
    D = lm.geometry.head_dim
    layers = F.text_layers(lm.model)
    enc = dict(alone(lm, ex))
    out = []

    def zero(layer):
        def pre(mod, args):
            x = args[0].clone().unflatten(-1, (H, D))
            for ly, h in heads:
                if ly == layer:
                    x[..., h, :] = 0
            return (x.flatten(-2),)
        return pre

    for _ in range(n_new):
        with torch.no_grad():
            base = lm.model(**enc).logits[0, -1].double().log_softmax(-1)
            hooks = [layers[ly].self_attn.o_proj.register_forward_pre_hook(zero(ly)) for ly in {h[0] for h in heads}]
            try:
                masked = lm.model(**enc).logits[0, -1].double().log_softmax(-1)
            finally:
                for h in hooks:
                    h.remove()
        token = int(((1 + alpha) * base - alpha * masked).argmax())
        out.append(token)
        for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            if key in enc:
                extra = torch.tensor([[token if key == "input_ids" else int(key == "attention_mask")]])
                enc[key] = torch.cat([enc[key], extra.to(enc[key].dtype)], dim=1)
    return out


@pytest.mark.parametrize("share_trunk", [True, False])
def test_decore_on_images_equals_a_naive_recomputing_loop(vlm, share_trunk):
    exs = F.examples(3)
    heads = [(1, 0), (1, 5), (2, 3)]
    decode = {"kind": "decore", "heads": [list(h) for h in heads], "alpha": 0.5, "mask": "output", "prefix": "masked",
              "share_trunk": share_trunk}
    ours = headlab.generate(vlm, exs, decode=decode, max_new_tokens=NEW)
    for r, ex in enumerate(exs):
        assert ours.tokens[r] == naive_decore(vlm, ex, heads, 0.5, NEW), r


def test_the_spec_in_the_docs_runs(tmp_path):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "vision.md").read_text()
    block = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)[0]
    run = headlab.run(block, out=tmp_path)
    answers = run.results["answers"]
    assert {"pope", "pope_accuracy", "pope_f1", "pope_yes_ratio", "vhr_selected", "preview_attention"} <= set(answers)
    assert answers["pope_yes_ratio"].dims == ()  # a step-level aggregate
    assert run.results["visual_heads"]["score"].dims == ("layer", "head")
