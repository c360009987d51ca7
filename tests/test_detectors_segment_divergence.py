"""segment_divergence (docs/methods.md#vhd) against an independent computation: eager models, one example at a
time, head outputs read by a forward pre-hook on each layer's ``o_proj`` (its input is the heads' ``z``)."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch
import transformers

import headlab

from fixtures.detectors import WORDS, build_models, save_tokenizer, tiny_config, word_tokenizer


def z_by_hooks(model, n_heads: int, **inputs) -> torch.Tensor:
    """(layer, head, head_dim) head outputs at the last position of one unpadded example (eager model)."""
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if name.endswith("self_attn.o_proj") and "vision" not in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, layer=layer: captured.__setitem__(layer, args[0][0, -1].detach().clone())))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([captured[i].view(n_heads, -1) for i in sorted(captured)]).double()


def reference_vhd(eager, ids: list[int], spans: list[tuple[int, int]], method: str, H: int):
    full = torch.tensor([ids])
    z1 = z_by_hooks(eager, H, input_ids=full)
    drop = {i for s, e in spans for i in range(s, e)}
    if method == "remove":
        kept = torch.tensor([[t for i, t in enumerate(ids) if i not in drop]])
        z0 = z_by_hooks(eager, H, input_ids=kept)
    else:  # keys of the span invisible to every query: an explicit 4-D additive mask, positions unchanged
        n = len(ids)
        allowed = torch.ones(n, n).tril().bool()
        for i in drop:
            allowed[:, i] = False
        allowed |= torch.eye(n, dtype=torch.bool) & ~allowed.any(-1, keepdim=True)  # a row needs one key
        bias = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
        z0 = z_by_hooks(eager, H, input_ids=full, attention_mask=bias)
    return (z1 - z0).norm(dim=-1).numpy(), z0.pow(2).sum(-1).numpy()


@pytest.fixture(scope="module")
def setup():
    tok = word_tokenizer()
    lm, models = build_models(tiny_config(len(tok), initializer_range=0.1), seed=1, tokenizer=tok)
    return tok, lm, models


def _records(n=5, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        w = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
        if rng.random() < 0.5:
            text = f"{w(rng.randint(1, 4))} <ctx>{w(rng.randint(2, 6))}</ctx> {w(rng.randint(1, 5))} ."
        else:  # two marked spans
            text = f"{w(2)} <ctx>{w(2)}</ctx> {w(1)} <ctx>{w(rng.randint(1, 3))}</ctx> {w(2)} ?"
        out.append({"text": text})
    return out


def test_segment_divergence_spec_equals_eager_hooks(tmp_path, setup):
    tok, _, models = setup
    records = _records()
    path = tmp_path / "seg.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    cfg = tiny_config(len(tok), initializer_range=0.1, tokenizer=save_tokenizer(tok, tmp_path / "tok"))
    spec = (f"name: t\nseed: 1\nmodel: {{config: {json.dumps(cfg)}}}\n"
            f"task: {{kind: jsonl, path: {path}, prompt: '{{{{ text }}}}', span_tags: {{context: ctx}}}}\n"
            "steps:\n  - id: rm\n    detect: {kind: segment_divergence, batch_size: 3}\n"
            "  - id: mk\n    detect: {kind: segment_divergence, method: mask, batch_size: 3}\n")
    run = headlab.run(spec, out=tmp_path / "runs")
    for step, method in (("rm", "remove"), ("mk", "mask")):
        ds = run.results[step]
        per = ds["example_score"].transpose("example", "layer", "head").values
        norm = ds["norm_without"].transpose("example", "layer", "head").values
        for i, prompt in enumerate(ds["prompt"].values):
            enc = tok(str(prompt), return_offsets_mapping=True)
            ids, offs = enc["input_ids"], enc["offset_mapping"]
            chars = []
            rest = records[i]["text"]
            while "<ctx>" in rest:  # character spans of the markers, in the stripped prompt
                a = rest.index("<ctx>")
                rest = rest.replace("<ctx>", "", 1)
                b = rest.index("</ctx>")
                rest = rest.replace("</ctx>", "", 1)
                chars.append((a, b))
            assert rest == str(prompt)
            spans = []
            for a, b in chars:
                toks = [j for j, (x, y) in enumerate(offs) if y > a and x < b and y > x]
                spans.append((toks[0], toks[-1] + 1))
            ref, ref_norm = reference_vhd(models["eager"], ids, spans, method, 4)
            np.testing.assert_allclose(per[i], ref, atol=1e-5, rtol=0)
            np.testing.assert_allclose(norm[i], ref_norm, atol=1e-5, rtol=1e-5)
            assert ref.max() > 1e-3
        np.testing.assert_allclose(ds["score"].transpose("layer", "head").values, per.mean(0), atol=1e-12)


def test_segment_divergence_llava_image_tokens():
    """A tiny LLaVA: the segment is the image tokens; without it, the image tokens are removed and no
    pixel values are given (VHR's text-only forward). Batched with left padding vs eager batch-1 hooks."""
    from headlab import instrument as ins
    from headlab.plugins.detectors.segment_divergence import segment_divergence

    V = 40
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=16, patch_size=8, projection_dim=32)
    tc = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=V + 3, max_position_embeddings=64,
                                  initializer_range=0.1)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=V + 1,
                                   vision_feature_layer=-1, vision_feature_select_strategy="default")
    ins.register()
    torch.manual_seed(0)
    cls = transformers.LlavaForConditionalGeneration
    me = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    mh = cls._from_config(copy.deepcopy(cfg), attn_implementation="headlab").eval()
    mh.load_state_dict(me.state_dict())
    n_img = 4
    g = torch.Generator().manual_seed(0)
    rows = []
    for before, after in ((2, 5), (4, 2)):
        rows.append(torch.randint(1, V, (before,), generator=g).tolist() + [V + 1] * n_img
                    + torch.randint(1, V, (after,), generator=g).tolist())
    n = max(len(r) for r in rows)
    ids = torch.zeros(2, n, dtype=torch.long)
    am = torch.zeros(2, n, dtype=torch.long)
    spans = []
    for r, row in enumerate(rows):
        pad = n - len(row)
        ids[r, pad:] = torch.tensor(row)
        am[r, pad:] = 1
        s = pad + row.index(V + 1)
        spans.append([(s, s + n_img)])
    pix = torch.randn(2, 3, 16, 16, generator=g)
    vhd, norm = segment_divergence(mh, ids, am, spans, forward_kwargs={"pixel_values": pix})
    for r, row in enumerate(rows):
        z1 = z_by_hooks(me, 4, input_ids=torch.tensor([row]), pixel_values=pix[r:r + 1])
        z0 = z_by_hooks(me, 4, input_ids=torch.tensor([[t for t in row if t != V + 1]]))
        np.testing.assert_allclose(vhd[r].numpy(), (z1 - z0).norm(dim=-1).numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(norm[r].numpy(), z0.pow(2).sum(-1).numpy(), atol=1e-5, rtol=1e-5)
    assert vhd.min() > 0


def test_segment_must_leave_the_generation_position(setup):
    from headlab.plugins.detectors.segment_divergence import segment_divergence

    _, lm, _ = setup
    ids = torch.tensor([[1, 5, 6, 7]])
    with pytest.raises(ValueError, match="last"):
        segment_divergence(lm.model, ids, torch.ones_like(ids), [[(2, 4)]])
