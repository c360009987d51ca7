"""The ``iti`` steering method (inference-time intervention) on a tiny random Llama with grouped-query attention,
against an eager copy of the model whose ``o_proj`` gets a hand-written forward pre-hook adding ``alpha * sigma
* theta`` to the steered heads' slices of its input at exactly the asked positions: greedy generation under the
KV cache (``positions: last`` and ``answer``) and scored log-likelihoods (``answer``, ``last``, ``all``) of a
left-padded batch, alone, with another steering method, and under DeCoRe and DoLa. The probe step's dataset is
built here with the ``probe`` detector's contract (``direction``, ``probe_direction``, ``sigma``)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import xarray as xr

from headlab import Plan
from headlab.generation import tokenize
from headlab.plugins.steering import iti as I
from headlab.scoring import generate, logprobs

from fixtures.steering import (
    D,
    build_tokenizer,
    emphasis_examples,
    hf_generate,
    hooked,
    loaded,
    step_ctx,
    tiny,
)

L, H = 2, 4
HEADS = [(0, 1), (1, 2), (1, 3)]  # (1, 2) and (1, 3) share a key/value head


def unit(rng: np.random.Generator, *shape: int) -> np.ndarray:
    v = rng.standard_normal((*shape, D))
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def probe_dataset(seed: int = 0, sigma_scale: float = 1.0, layers: int = L, heads: int = H,
                  head_dim: int = D) -> xr.Dataset:
    """A probe step's dataset: unit directions and positive sigmas per head."""
    rng = np.random.default_rng(seed)
    shape = (layers, heads, head_dim)
    direction = rng.standard_normal(shape)
    probe_direction = rng.standard_normal(shape)
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    probe_direction /= np.linalg.norm(probe_direction, axis=-1, keepdims=True)
    return xr.Dataset({
        "score": (("layer", "head"), rng.uniform(0.5, 1.0, (layers, heads))),
        "direction": (("layer", "head", "head_dim"), direction),
        "probe_direction": (("layer", "head", "head_dim"), probe_direction),
        "sigma": (("layer", "head"), sigma_scale * rng.uniform(0.5, 2.0, (layers, heads))),
    }, attrs={"method": "probe"})


RESULTS = {"pr": probe_dataset(0), "held_out": probe_dataset(1)}


def vectors(cfg: dict) -> dict[tuple[int, int], torch.Tensor]:
    """``alpha * sigma * theta`` of each steered head, from the datasets directly."""
    ds = RESULTS[cfg["probe"]]
    sds = RESULTS[cfg.get("sigma_from") or cfg["probe"]]
    direction = cfg.get("direction", "mass_mean")
    if direction == "random":
        rng = np.random.default_rng(cfg.get("seed", 0))
        v = rng.standard_normal((L, H, D))
        theta = v / np.linalg.norm(v, axis=-1, keepdims=True)
    else:
        theta = ds["probe_direction" if direction == "probe" else "direction"].values
    alpha = cfg.get("alpha", 15.0)
    return {(ly, h): torch.tensor(alpha * sds["sigma"].values[ly, h] * theta[ly, h], dtype=torch.float32)
            for ly, h in cfg["heads"]}


@contextlib.contextmanager
def iti_hooks(model, vecs: dict[tuple[int, int], torch.Tensor], starts: list[int]):
    """Pre-hooks on ``o_proj`` adding ``vecs[(l, h)]`` to head ``h``'s slice of its input at every position ``>=
    starts[row]`` of each row; positions are counted over the calls (the prefill, then one per decode step)."""
    seen = {}
    hooks = []
    for layer in sorted({ly for ly, _ in vecs}):
        seen[layer] = 0

        def pre(mod, args, layer=layer):
            x = args[0].clone()
            n = x.shape[1]
            first = seen[layer]
            seen[layer] += n
            for (ly, h), v in vecs.items():
                if ly != layer:
                    continue
                for row, start in enumerate(starts):
                    for i in range(n):
                        if first + i >= start:
                            x[row, i, h * D:(h + 1) * D] += v
            return (x,)

        hooks.append(model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(pre))
    try:
        yield
    finally:
        for hk in hooks:
            hk.remove()


def cfg_of(**kw) -> dict:
    return {"kind": "iti", "probe": "pr", "heads": [list(h) for h in HEADS], **kw}


def prompts() -> list[str]:
    return [ex.prompt for ex in emphasis_examples(3, seed=3)]


@pytest.mark.parametrize("direction, positions", [("mass_mean", "last"), ("probe", "answer"), ("random", "last")])
def test_generation_equals_the_eager_hook_under_the_kv_cache(direction, positions):
    mh, me = tiny("headlab"), tiny("eager")
    ps = prompts()
    batch = tokenize(loaded(mh), emphasis_examples(3, seed=3))
    assert len(set(batch.pad)) > 1  # left padding
    cfg = cfg_of(direction=direction, positions=positions, alpha=4.0, sigma_from="held_out", seed=5)
    ours = generate(loaded(mh), ps, steer=[cfg], max_new_tokens=6, results=RESULTS)
    start = batch.length - 1 if positions == "last" else batch.length
    with iti_hooks(me, vectors(cfg), [start] * batch.size):
        ref = hf_generate(me, batch, 6).tolist()
    plain = hf_generate(me, batch, 6).tolist()
    assert ours.tokens == ref
    assert ref != plain  # the intervention changes the output


def eager_logprob(model, prompt_ids: list[int], cont_ids: list[int], start: int | None,
                  vecs: dict[tuple[int, int], torch.Tensor]) -> float:
    """Summed log-probability of ``cont_ids`` after ``prompt_ids`` (one unpadded row), ITI from ``start`` on."""
    ids = torch.tensor([prompt_ids + cont_ids])
    ctx = iti_hooks(model, vecs, [start]) if start is not None else contextlib.nullcontext()
    with ctx, torch.no_grad():
        logits = model(input_ids=ids).logits[0].double().log_softmax(-1)
    n = len(prompt_ids)
    return float(sum(logits[n - 1 + i, t] for i, t in enumerate(cont_ids)))


def _choices() -> tuple[list[str], list[str]]:
    ps = prompts()
    words = [p.split() for p in ps]
    conts = [" " + " ".join(words[0][1:3]), " " + words[1][4], " " + " ".join(words[2][2:5])]  # 2, 1, 3 tokens
    return ps, conts


@pytest.mark.parametrize("positions", ["answer", "last", "all"])
def test_scored_loglikelihoods_equal_the_eager_hook(positions):
    mh, me = tiny("headlab"), tiny("eager")
    tok = build_tokenizer()
    ps, conts = _choices()
    cfg = cfg_of(positions=positions, alpha=6.0)
    ours = logprobs(loaded(mh), ps, conts, steer=[cfg], results=RESULTS, batch_size=3)
    plain = logprobs(loaded(mh), ps, conts, results=RESULTS, batch_size=3)
    vecs = vectors(cfg)
    for i, (p, c) in enumerate(zip(ps, conts, strict=True)):
        full = tok(p + c)["input_ids"]
        prompt_ids = tok(p)["input_ids"]
        n = len(prompt_ids)
        start = {"answer": n, "last": n - 1, "all": 0}[positions]
        want = eager_logprob(me, full[:n], full[n:], start, vecs)
        assert ours.logprobs[i] == pytest.approx(want, abs=1e-5)
        if positions == "answer" and len(full) - n == 1:  # its one token is predicted at the unedited prompt's end
            assert plain.logprobs[i] == pytest.approx(want, abs=1e-5)
        else:
            assert abs(plain.logprobs[i] - want) > 1e-3


def test_combined_with_another_steering_method_and_decoders():
    """ITI plus an output scale of another head equals both hooks; under DeCoRe with alpha 0 (its base copy's
    greedy choice) ITI's edits reach the rows it decodes from, and with alpha 1 the layers below its masked
    head, run once for both copies (ITI steers head (0, 1) there), give what they give run apart; under DoLa
    (its early exits read the steered forward) it equals DoLa on the eager model carrying the hooks."""
    mh, me = tiny("headlab"), tiny("eager")
    ps = prompts()
    batch = tokenize(loaded(mh), emphasis_examples(3, seed=3))
    cfg = cfg_of(alpha=4.0)
    scale = {"kind": "head_scale", "heads": [[0, 2]], "factor": 0.5}
    ours = generate(loaded(mh), ps, steer=[cfg, scale], max_new_tokens=5, results=RESULTS)
    with hooked(me, [(0, 2)], "o", 0.5), iti_hooks(me, vectors(cfg), [batch.length - 1] * batch.size):
        ref = hf_generate(me, batch, 5).tolist()
    assert ours.tokens == ref
    with iti_hooks(me, vectors(cfg), [batch.length - 1] * batch.size):
        ref_iti = hf_generate(me, batch, 5).tolist()
    decore = {"kind": "decore", "heads": [[1, 0]], "alpha": 0.0}
    assert generate(loaded(mh), ps, steer=[cfg], decode=decore, max_new_tokens=5, results=RESULTS).tokens == ref_iti
    shared = generate(loaded(mh), ps, steer=[cfg], decode={**decore, "alpha": 1.0}, max_new_tokens=5,
                      results=RESULTS)
    apart = generate(loaded(mh), ps, steer=[cfg], decode={**decore, "alpha": 1.0, "share_trunk": False},
                     max_new_tokens=5, results=RESULTS)
    assert shared.tokens == apart.tokens
    dola = {"kind": "dola", "layers": [0, 1]}  # the same DoLa decoder on the eager model carrying the ITI hooks
    with iti_hooks(me, vectors(cfg), [batch.length - 1] * batch.size):
        ref_dola = generate(loaded(me), ps, decode=dola, max_new_tokens=5).tokens
    assert generate(loaded(mh), ps, steer=[cfg], decode=dola, max_new_tokens=5, results=RESULTS).tokens == ref_dola
    assert ref_dola != generate(loaded(me), ps, decode=dola, max_new_tokens=5).tokens


def test_heads_from_the_probe_step_and_errors():
    mh = tiny("headlab")
    batch = tokenize(loaded(mh), emphasis_examples(2, seed=3))
    flat = probe_dataset(5)
    flat["direction"][0, 1] = np.nan  # a head whose classes have equal means
    ctx = step_ctx(mh, batch.examples, results={**RESULTS, "dla": xr.Dataset(
        {"score": (("layer", "head"), np.zeros((L, H)))}, attrs={"method": "direct_logit_attribution"}),
        "other": probe_dataset(2, layers=3, heads=4), "huge": probe_dataset(3, sigma_scale=1e30),
        "means": probe_dataset(4).drop_vars("probe_direction"), "flat": flat})
    plan = Plan()
    I.steer(I.Iti(probe="pr", heads={"from": "pr", "top": 3}), ctx, batch, plan)
    top3 = sorted(np.argsort(-RESULTS["pr"]["score"].values.ravel())[:3])
    assert sorted(ly * H + h for ly, h in plan.edits[0].heads) == top3
    with pytest.raises(ValueError, match=r"iti: probe: step 'dla' is a 'direct_logit_attribution' step: it has no "
                                         r"direction or sigma; name a probe step"):
        I.steer(I.Iti(probe="dla", heads=[[0, 1]]), ctx, batch, Plan())
    with pytest.raises(ValueError, match=r"iti: probe: 'nope' is not an earlier step of this cell"):
        I.steer(I.Iti(probe="nope", heads=[[0, 1]]), ctx, batch, Plan())
    with pytest.raises(ValueError, match=r"iti: sigma_from: step 'other' has another model's geometry \(3 layers x "
                                         r"4 heads, head_dim 16\); this model has 2 x 4, head_dim 16"):
        I.steer(I.Iti(probe="pr", sigma_from="other", heads=[[0, 1]]), ctx, batch, Plan())
    with pytest.raises(ValueError, match=r"iti: alpha 1e\+10 times sigma .* of head \(0, 1\) is .*, beyond the "
                                         r"model's float32 range; lower alpha"):
        I.steer(I.Iti(probe="pr", sigma_from="huge", alpha=1e10, heads=[[0, 1]]), ctx, batch, Plan())
    with pytest.raises(ValueError, match=r"iti: direction: probe: step 'means' has no probe_direction"):
        I.steer(I.Iti(probe="means", direction="probe", heads=[[0, 1]]), ctx, batch, Plan())
    I.steer(I.Iti(probe="flat", heads=[[0, 2]]), ctx, batch, Plan())
    with pytest.raises(ValueError, match=r"iti: step 'flat' has no finite direction for head\(s\) \[\(0, 1\)\]"):
        I.steer(I.Iti(probe="flat", heads=[[0, 2], [0, 1]]), ctx, batch, Plan())
