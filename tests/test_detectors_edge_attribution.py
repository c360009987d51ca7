"""edge_attribution (docs/methods.md#edge-attribution): EAP and EAP-IG scores against a hook-based computation on
tiny float64 Llama (grouped-query attention) and GPT-2 models, written here with the dense layout
(every source's output in d_model, a copy of the residual stream per destination fed to the model's own norm
and projection); exact edge patching against a dense reference with the same hooks; circuit extraction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import headlab.plugins.detectors.edge_attribution as ea
from headlab import StepContext, positions_from_mask
from headlab.plugins.detectors.edge_attribution import (
    EdgeAttribution,
    detect,
    edge_graph,
    patch_circuit,
    record,
)
from headlab.plugins.detectors.norms import affine_norm
from headlab.plugins.tasks.pairs import pair_example

from fixtures.circuits import WORDS, models, pair_examples


# --------------------------------------------------------------------------- the eager model's parts, by hand
def _parts(model, arch: str, layer: int) -> dict:
    if arch == "gpt2":
        block = model.transformer.h[layer]
        return {"norm": block.ln_1, "qkv": block.attn.c_attn, "out": block.attn.c_proj, "mlp": block.mlp,
                "mlp_norm": block.ln_2}
    block = model.model.layers[layer]
    attn = block.self_attn
    return {"norm": block.input_layernorm, "q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "out": attn.o_proj,
            "mlp": block.mlp, "mlp_norm": block.post_attention_layernorm}


def _final_norm(model, arch: str):
    return model.transformer.ln_f if arch == "gpt2" else model.model.norm


def _project(parts: dict, arch: str, part: str, x: torch.Tensor, H: int, K: int, D: int) -> torch.Tensor:
    """The query (key, value) projection of a normed input, (..., heads, D), without the module's hooks."""
    if arch == "gpt2":
        lin = parts["qkv"]
        out = torch.addmm(lin.bias, x.reshape(-1, x.shape[-1]), lin.weight).reshape(*x.shape[:-1], -1)
        d = H * D
        out = {"q": out[..., :d], "k": out[..., d:2 * d], "v": out[..., 2 * d:]}[part]
    else:
        out = torch.nn.functional.linear(x, parts[part].weight, parts[part].bias)
    return out.unflatten(-1, (-1, D))


def _out_weight(parts: dict, arch: str, head: int, D: int) -> torch.Tensor:
    """W_O[head] (D, d_model)."""
    w = parts["out"].weight
    return w[head * D:(head + 1) * D] if arch == "gpt2" else w[:, head * D:(head + 1) * D].T


def _names(L: int, H: int, K: int) -> tuple[dict, dict]:
    """Source and destination names with their place in the block order."""
    src, dst = {"emb": -1}, {}
    for layer in range(L):
        src.update({f"a{layer}.h{h}": 2 * layer for h in range(H)})
        src[f"m{layer}"] = 2 * layer + 1
        dst.update({f"a{layer}.h{h}.q": 2 * layer for h in range(H)})
        dst.update({f"a{layer}.kv{j}.{p}": 2 * layer for p in "kv" for j in range(K)})
        dst[f"m{layer}"] = 2 * layer + 1
    dst["logits"] = 2 * L
    return src, dst


def _destination_slots(L: int, H: int, K: int) -> list[tuple[str, int, str, int]]:
    """(name, layer, part, head) of every q / k / v destination."""
    out = []
    for layer in range(L):
        out += [(f"a{layer}.h{h}.q", layer, "q", h) for h in range(H)]
        out += [(f"a{layer}.kv{j}.{p}", layer, p, j) for p in "kv" for j in range(K)]
    return out


class Reference:
    """Hooks on the eager model: each destination reads its own copy of the residual stream."""

    def __init__(self, model, arch: str, lm):
        geo = lm.geometry
        self.model, self.arch = model, arch
        self.L, self.H, self.K, self.D = geo.n_layers, geo.n_heads, geo.n_kv_heads, geo.head_dim
        self.parts = [_parts(model, arch, layer) for layer in range(self.L)]

    def _run(self, ids, mask, answer, wrong, metric, shift, embeds=None, outputs=None):
        """One forward; ``shift(name, x)`` gives destination ``name``'s input from the residual ``x``; returns
        the metric (pair,) and the sources' outputs of this run (name -> (pair, T, d_model))."""
        H, K, D, arch = self.H, self.K, self.D, self.arch
        outputs = {} if outputs is None else outputs
        xs, inside, handles = {}, [False], []

        def norm_hook(layer):
            def hook(m, args):
                if not inside[0]:
                    xs[layer] = args[0]
                    if layer == 0:
                        outputs["emb"] = args[0]
            return hook

        def projection_hook(layer, part_names):
            def hook(m, args, out):
                pieces = []
                for part in part_names:
                    n = H if part == "q" else K
                    heads = []
                    for j in range(n):
                        name = f"a{layer}.h{j}.q" if part == "q" else f"a{layer}.kv{j}.{part}"
                        inside[0] = True
                        normed = self.parts[layer]["norm"](shift(name, xs[layer]))
                        inside[0] = False
                        heads.append(_project(self.parts[layer], arch, part, normed, H, K, D)[..., j, :])
                    pieces.append(torch.stack(heads, dim=-2).flatten(-2))
                return torch.cat(pieces, dim=-1)
            return hook

        def out_hook(layer):
            def hook(m, args):
                z = args[0].unflatten(-1, (H, D))
                for h in range(H):
                    outputs[f"a{layer}.h{h}"] = z[..., h, :] @ _out_weight(self.parts[layer], arch, h, D)
            return hook

        for layer, p in enumerate(self.parts):
            handles.append(p["norm"].register_forward_pre_hook(norm_hook(layer)))
            if arch == "gpt2":
                handles.append(p["qkv"].register_forward_hook(projection_hook(layer, "qkv")))
            else:
                for part in "qkv":
                    handles.append(p[part].register_forward_hook(projection_hook(layer, part)))
            handles.append(p["out"].register_forward_pre_hook(out_hook(layer)))
            handles.append(p["mlp"].register_forward_hook(
                lambda m, a, o, layer=layer: outputs.__setitem__(f"m{layer}", o)))
            handles.append(p["mlp_norm"].register_forward_pre_hook(
                lambda m, a, layer=layer: (shift(f"m{layer}", a[0]),)))
        handles.append(_final_norm(self.model, arch).register_forward_pre_hook(
            lambda m, a: (shift("logits", a[0]),)))
        if embeds is not None:
            handles.append(self.model.get_input_embeddings().register_forward_hook(lambda m, a, o: embeds(o)))
        try:
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        finally:
            for handle in handles:
                handle.remove()
        last = logits[:, -1].double()
        rows = torch.arange(len(answer))
        if metric == "logit_diff":
            value = last[rows, answer] - last[rows, wrong]
        else:
            value = torch.log_softmax(last, -1)[rows, answer]
        return value, outputs

    def sources(self, ids, mask, answer, wrong, metric):
        """Every source's output (name -> (pair, T, d_model)) of a plain run."""
        with torch.no_grad():
            return self._run(ids, mask, answer, wrong, metric, lambda name, x: x)[1]

    def gradients(self, ids, mask, answer, wrong, metric, embeds=None) -> dict:
        """d metric / d (input of each destination), name -> (pair, T, d_model), through zero tensors added to
        each destination's own copy of the residual stream."""
        leaves: dict = {}

        def shift(name, x):
            leaves[name] = torch.zeros_like(x, requires_grad=True)
            return x + leaves[name]

        with torch.enable_grad():
            value, _ = self._run(ids, mask, answer, wrong, metric, shift, embeds)
            names = list(leaves)
            grads = torch.autograd.grad(value.sum(), [leaves[n] for n in names])
        return dict(zip(names, grads, strict=True))

    def patched(self, ids, mask, answer, wrong, metric, corrupt: dict, dropped: set) -> torch.Tensor:
        """The metric of a run whose dropped edges (source, destination) carry ``corrupt``'s source values and
        every other edge the value its source has in this run."""
        outputs: dict = {}

        def shift(name, x):
            for src, dst in dropped:
                if dst == name:
                    x = x - (outputs[src] - corrupt[src])
            return x

        with torch.no_grad():
            return self._run(ids, mask, answer, wrong, metric, shift, outputs=outputs)[0]


# --------------------------------------------------------------------------- set-up and the reference scores
def _setup(arch: str, metric: str = "logit_diff"):
    tok, lm, _ = models(arch)
    lm.model.double()  # the eager copy gives NaN on left-padded rows in float64; the hooks work on any copy
    examples = pair_examples(tok)  # three lengths: one left-padded chunk
    answer = [ex.meta["answer_id"] for ex in examples]
    wrong = [ex.meta["wrong_id"] for ex in examples]
    runs = record(lm, examples, answer, wrong, metric)
    return lm, examples, runs, Reference(lm.model, arch, lm)


def _rows(runs, which: str):
    p = runs.pairs
    r = p.rows(which)
    return p.ids[r], p.mask[r], p.answer, p.wrong


def _reference_scores(ref: Reference, runs, metric: str, direction: str, steps: int = 1) -> dict:
    """{(source, destination): score} from the dense layout, with the hand loop over interpolation steps."""
    base, other = ("clean", "corrupt") if direction == "noise" else ("corrupt", "clean")
    a_base = ref.sources(*_rows(runs, base), metric)
    a_other = ref.sources(*_rows(runs, other), metric)
    with torch.no_grad():
        e_other = ref.model.get_input_embeddings()(_rows(runs, other)[0])
    grads: dict = {}
    for k in range(1, steps + 1):
        alpha = k / steps
        embeds = None if alpha == 1 else (lambda o, alpha=alpha: e_other + alpha * (o - e_other))
        for name, g in ref.gradients(*_rows(runs, base), metric, embeds).items():
            grads[name] = grads.get(name, 0) + g / steps
    src, dst = _names(ref.L, ref.H, ref.K)
    n = runs.pairs.n
    real = runs.pairs.mask[:n].bool()[..., None]  # a pair's positions (not its left padding)
    return {(s, d): float(torch.where(real, (a_other[s] - a_base[s]).double() * grads[d].double(), 0).sum()) / n
            for s in src for d in dst if src[s] < dst[d]}


def _by_edge(ds) -> dict:
    return {(str(s), str(d)): float(v) for s, d, v in
            zip(ds["source"].values, ds["destination"].values, ds["score"].values, strict=True)}


def _assert_scores(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    keys = sorted(want)
    g, w = np.array([got[k] for k in keys]), np.array([want[k] for k in keys])
    scale = np.abs(w).max()
    assert scale > 1e-2
    # the RMS norms compute in float32 even in a float64 model
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * scale)


# --------------------------------------------------------------------------- scores
@pytest.mark.parametrize(("arch", "metric", "direction"),
                         [("llama", "logit_diff", "noise"), ("gpt2", "logit_diff", "noise"),
                          ("llama", "logprob", "denoise")])
def test_eap_equals_the_hook_reference(arch, metric, direction):
    lm, examples, runs, ref = _setup(arch, metric)
    ds = detect(EdgeAttribution(metric=metric, direction=direction), StepContext(model=lm, examples=examples,
                                                                                 results={}, seed=0))
    _assert_scores(_by_edge(ds), _reference_scores(ref, runs, metric, direction))
    geo = lm.geometry
    graph = edge_graph(geo.n_layers, geo.n_heads, geo.n_kv_heads)
    assert ds.sizes["edge"] == int(graph.valid.sum()) == ds.attrs["n_edges"]
    np.testing.assert_allclose(ds["clean"].values, runs.pairs.metric[:3].numpy())
    assert ds.attrs["direction"] == direction and ds.attrs["estimator"] == "eap"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eap_ig_is_eap_for_one_step_and_the_hand_loop_for_several(arch):
    lm, examples, runs, ref = _setup(arch)
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    eap = detect(EdgeAttribution(), ctx)
    one = detect(EdgeAttribution(method="eap_ig", ig_steps=1), ctx)
    np.testing.assert_array_equal(one["score"].values, eap["score"].values)
    three = detect(EdgeAttribution(method="eap_ig", ig_steps=3), ctx)
    want = _reference_scores(ref, runs, "logit_diff", "noise", steps=3)
    _assert_scores(_by_edge(three), want)
    assert three.attrs["ig_steps"] == 3
    # the interpolation changes the scores (the hand loop is not EAP again)
    assert np.abs(three["score"].values - eap["score"].values).max() > 1e-3


# --------------------------------------------------------------------------- exact edge patching
def _corrupt_sources(ref: Reference, runs) -> dict:
    return ref.sources(*_rows(runs, "corrupt"), "logit_diff")


def _keep(graph, dropped: set) -> np.ndarray:
    src, dst = list(graph.sources), list(graph.destinations)
    keep = graph.valid.copy()
    for s, d in dropped:
        assert keep[src.index(s), dst.index(d)]
        keep[src.index(s), dst.index(d)] = False
    return keep


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_edge_patching_of_every_edge_and_of_none(arch):
    lm, _, runs, _ = _setup(arch)
    geo = lm.geometry
    graph = edge_graph(geo.n_layers, geo.n_heads, geo.n_kv_heads)
    clean, corrupt = runs.pairs.metric[:3].numpy(), runs.pairs.metric[3:].numpy()
    assert np.abs(clean - corrupt).max() > 0.1
    every = patch_circuit(lm, runs, graph, graph.valid, "logit_diff").numpy()
    np.testing.assert_allclose(every, clean, rtol=1e-6, atol=1e-6)
    none = patch_circuit(lm, runs, graph, np.zeros_like(graph.valid), "logit_diff").numpy()
    np.testing.assert_allclose(none, corrupt, rtol=1e-5, atol=1e-5)


CASES = {
    "llama": [{("a0.h1", "a1.kv0.k")}, {("emb", "m0")}, {("m0", "logits")}, {("a0.h2", "a1.h3.q")},
              {("emb", "a0.h0.q"), ("a0.h0", "logits")},
              {("a0.h3", "a1.kv1.v"), ("m0", "a1.kv1.v"), ("emb", "a1.kv1.v")}],
    "gpt2": [{("a0.h3", "a1.kv3.v")}, {("emb", "a0.kv1.k"), ("a0.h1", "m0"), ("a0.h1", "logits")},
             {("m1", "logits")}],
}


@pytest.mark.parametrize(("arch", "case"), [(a, i) for a, cases in CASES.items() for i in range(len(cases))])
def test_edge_patching_equals_the_hand_written_reference(arch, case):
    lm, _, runs, ref = _setup(arch)
    geo = lm.geometry
    graph = edge_graph(geo.n_layers, geo.n_heads, geo.n_kv_heads)
    dropped = CASES[arch][case]
    got = patch_circuit(lm, runs, graph, _keep(graph, dropped), "logit_diff").numpy()
    want = ref.patched(*_rows(runs, "clean"), "logit_diff", _corrupt_sources(ref, runs), dropped).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.abs(got - runs.pairs.metric[:3].numpy()).max() > 1e-4  # the patch changed the metric


def test_edge_patching_of_a_random_circuit():
    lm, _, runs, ref = _setup("llama")
    geo = lm.geometry
    graph = edge_graph(geo.n_layers, geo.n_heads, geo.n_kv_heads)
    src, dst = graph.edges
    rng = np.random.default_rng(0)
    out = rng.random(len(src)) < 0.5
    dropped = {(graph.sources[s], graph.destinations[d]) for s, d in zip(src[out], dst[out], strict=True)}
    got = patch_circuit(lm, runs, graph, _keep(graph, dropped), "logit_diff").numpy()
    want = ref.patched(*_rows(runs, "clean"), "logit_diff", _corrupt_sources(ref, runs), dropped).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- the detector's circuit
def test_circuit_extraction_and_faithfulness():
    lm, examples, runs, _ = _setup("gpt2")
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    ds = detect(EdgeAttribution(circuit={"top": 12}), ctx)
    score, keep = ds["score"].values, ds["in_circuit"].values
    assert keep.sum() == 12 == ds.attrs["circuit_edges"]
    assert np.abs(score[keep]).min() >= np.abs(score[~keep]).max()
    geo = lm.geometry
    graph = edge_graph(geo.n_layers, geo.n_heads, geo.n_kv_heads)
    matrix = np.zeros(graph.valid.shape, dtype=bool)
    src, dst = graph.edges
    matrix[src[keep], dst[keep]] = True
    np.testing.assert_allclose(ds["circuit"].values, patch_circuit(lm, runs, graph, matrix, "logit_diff").numpy(),
                               rtol=1e-12)
    c, k, p = ds["clean"].values.mean(), ds["corrupt"].values.mean(), ds["circuit"].values.mean()
    assert ds.attrs["faithfulness"] == pytest.approx(p / c, rel=1e-12)
    assert ds.attrs["faithfulness_normalised"] == pytest.approx((p - k) / (c - k), rel=1e-12)
    # every edge: the full model; no edge (a threshold above every score): the corrupted run
    full = detect(EdgeAttribution(circuit={"top": ds.sizes["edge"] + 5}), ctx)
    assert full.attrs["faithfulness"] == pytest.approx(1, abs=1e-6)
    assert full.attrs["faithfulness_normalised"] == pytest.approx(1, abs=1e-6)
    empty = detect(EdgeAttribution(circuit={"threshold": float(np.abs(score).max()) * 2}), ctx)
    assert not empty["in_circuit"].values.any()
    assert empty.attrs["faithfulness_normalised"] == pytest.approx(0, abs=1e-5)
    cut = float(np.sort(np.abs(score))[-7])
    some = detect(EdgeAttribution(circuit={"threshold": cut}), ctx)
    assert some["in_circuit"].values.sum() == 7


def test_memory_per_token_is_what_the_runs_keep():
    lm, examples, runs, _ = _setup("llama")
    ds = detect(EdgeAttribution(), StepContext(model=lm, examples=examples, results={}, seed=0))
    n, T = runs.pairs.n, runs.pairs.ids.shape[1]
    kept = sum(t[:n].nelement() * t.element_size() for t in (runs.pairs.z, runs.mlp, runs.emb))
    assert ds.attrs["activation_bytes_per_token"] == kept // (n * T)
    geo = lm.geometry
    graph = edge_graph(geo.n_layers, geo.n_heads, geo.n_kv_heads)
    d_model = runs.emb.shape[-1]
    assert ds.attrs["dense_bytes_per_token"] == len(graph.sources) * d_model * runs.emb.element_size()
    assert ds.attrs["activation_bytes_per_token"] < ds.attrs["dense_bytes_per_token"]


# --------------------------------------------------------------------------- graph and errors
def test_the_graph():
    graph = edge_graph(2, 4, 2)
    assert graph.sources == ["emb", "a0.h0", "a0.h1", "a0.h2", "a0.h3", "m0", "a1.h0", "a1.h1", "a1.h2", "a1.h3",
                             "m1"]
    assert graph.destinations[:9] == ["a0.h0.q", "a0.h1.q", "a0.h2.q", "a0.h3.q", "a0.kv0.k", "a0.kv1.k",
                                      "a0.kv0.v", "a0.kv1.v", "m0"]
    src, dst = _names(2, 4, 2)
    want = {(s, d) for s in src for d in dst if src[s] < dst[d]}
    s, d = graph.edges
    assert {(graph.sources[i], graph.destinations[j]) for i, j in zip(s, d, strict=True)} == want
    assert ("a0.h1", "m0") in want and ("a0.h1", "a0.h2.q") not in want and ("m0", "a1.kv0.k") in want
    with pytest.raises(ValueError, match="not a multiple"):
        edge_graph(2, 4, 3)


def test_errors():
    with pytest.raises(ValidationError, match="exactly one of top"):
        EdgeAttribution.model_validate({"kind": "edge_attribution", "circuit": {}})
    with pytest.raises(ValidationError, match="exactly one of top"):
        EdgeAttribution.model_validate({"kind": "edge_attribution", "circuit": {"top": 3, "threshold": 0.1}})
    tok, lm, _ = models("gemma2")
    with pytest.raises(ValueError, match="gemma2 normalises each attention output before the residual stream"):
        detect(EdgeAttribution(), StepContext(model=lm, examples=pair_examples(tok), results={}, seed=0))


def test_scoring_a_step_holds_one_layers_destination_gradients_beyond_what_it_keeps():
    from headlab.kv.usage import LiveBytes  # the live-tensor peak (bench_kv.py's CPU measure)

    tok, lm, _ = models("llama")
    words = [w for w in WORDS if len(tok(" " + w, add_special_tokens=False)["input_ids"]) == 1][:12]
    clean = " ".join(words[i % len(words)] for i in range(80))
    ex = [pair_example(tok, clean, clean.replace(words[3], words[5], 1), words[0], words[1], "long")]
    runs = record(lm, ex, [ex[0].meta["answer_id"]], [ex[0].meta["wrong_id"]], "logit_diff")
    g = lm.geometry
    graph = edge_graph(g.n_layers, g.n_heads, g.n_kv_heads)
    parts = [ea.block_parts(lm, layer) for layer in range(g.n_layers)]
    d_model = lm.model.config.hidden_size
    rules = [affine_norm(p.norm, d_model) for p in parts]
    p = runs.pairs
    grads = ea._gradients(lm, parts, p.ids[p.rows("clean")], p.mask[p.rows("clean")], p.answer, p.wrong, "logit_diff")
    delta = ea._deltas(runs, "clean", "corrupt")
    with LiveBytes() as live:
        scores = ea._step_scores(lm, rules, graph, grads, delta, torch.float32)
    tokens = p.ids.shape[1]
    transient = ea.memory_per_token(lm)["transient_bytes_per_token"] * tokens
    assert transient == (g.n_heads + 2 * g.n_kv_heads + min(g.n_heads, ea.HEAD_BLOCK)) * d_model * 4 * tokens
    # one layer's gradients are made: the peak is at least them, and at most them and a few (pair, T, d_model)
    # tensors (the norm's unit vectors, a block's reshapes) more; copies of them (an einsum's permuted operand,
    # the previous layer's still alive) or of the pulled-back norm's activations would exceed it
    assert (g.n_heads + 2 * g.n_kv_heads) * d_model * 4 * tokens <= live.peak <= 1.5 * transient + scores.nbytes
