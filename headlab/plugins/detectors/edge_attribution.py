"""Edge attribution patching (EAP, EAP-IG), circuit extraction and exact edge patching of a circuit.

Definition: docs/methods.md#edge-attribution. The graph (:func:`edge_graph`): the sources are the embeddings
``emb`` (token plus position embeddings: the residual stream entering layer 0), every head's output
``a{l}.h{h}`` (``z[l,h] W_O[h]``, without ``b_O``) and every MLP's output ``m{l}``; the destinations are every
head's query input ``a{l}.h{h}.q``, every key/value head's key and value inputs ``a{l}.kv{j}.k`` /
``a{l}.kv{j}.v`` (one per key/value head under grouped-query attention), every MLP's input ``m{l}`` and the
logits ``logits``. A destination's input is the residual stream as it enters it, before the norm: the
attention norm's input for ``q`` / ``k`` / ``v``, the MLP norm's input for ``m{l}``, the final norm's input for
``logits``. An edge joins a source to each destination after it in the block order: the heads of layer ``l``
feed the MLP of layer ``l`` and everything of later layers; the MLP of layer ``l`` feeds layers ``> l``; every
supported architecture runs attention then MLP (those that normalise the attention output before the residual
stream, gemma2 and olmo2, are refused: a head's output there is not ``z W_O``).

Scores (``direction: noise``, the default, the published EAP's convention): the base run is the clean prompt,
``score(u -> v) = sum over positions of (a_u(corrupt) - a_u(clean)) . d metric / d x_v`` with the gradient on
the clean run, the first-order estimate of ``m(clean with edge u -> v corrupted) - m(clean)``, summed over a
pair's positions and averaged over the pairs. ``denoise`` swaps the runs (``a_u(clean) - a_u(corrupt)``, the
gradient on the corrupted run), as ``attribution_patching``'s ``direction`` does. ``method: eap_ig`` (Hanna et
al. 2024) averages the gradient over ``ig_steps`` runs whose input embeddings are ``e_other + k/m (e_base -
e_other)``, ``k = 1..m`` (``k = m`` is the base run: one step is EAP).

The gradients: one forward and one backward per step and chunk of pairs. Zero tensors that require grad are
added to the outputs of the query, key and value projections (forward hooks), to the MLP norm's input and to
the final norm's input (forward pre-hooks); their gradients are each head's own ``d metric / d q_h`` (``k``,
``v`` per key/value head), and the MLP and logits destinations' gradients. A head's destination gradient is
``J^T (d metric / d q_h) W_Q[h]^T`` with ``J`` the attention norm's Jacobian at the layer's input, computed
after the backward in closed form from the norm's gain and the layer's input (:func:`_norm_vjp`): the gradient
a copy of the residual per destination would get, without a copy per destination in the forward. The activation
differences are kept per head (``z``, head_dim wide) and projected through ``W_O`` :data:`HEAD_BLOCK` heads at a
time, so beyond what it keeps a step holds one layer's destination gradients (``H + 2K`` d_model vectors per
token) and that block of heads' outputs (``attrs["transient_bytes_per_token"]``).

Circuit (``circuit: {top: k}`` or ``{threshold: t}``): the edges with the ``k`` largest ``|score|`` or those
with ``|score| >= t``. Exact edge patching runs the clean prompt once; each destination's input becomes its
clean-run input minus ``sum over incoming edges outside the circuit of (a_u(this run) - a_u(corrupt))``, so
edges in the circuit carry the source's value in this run and the others the corrupted value
(:func:`patch_circuit`). ``faithfulness = mean circuit metric / mean clean metric``;
``faithfulness_normalised = (mean circuit - mean corrupt) / (mean clean - mean corrupt)``.

Outputs: ``score (edge)`` with the coordinates ``source (edge)`` and ``destination (edge)``, ``clean (example)``,
``corrupt (example)``; with a circuit, ``in_circuit (edge)`` and ``circuit (example)`` (the patched metric).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field, model_validator
from torch import Tensor

from headlab.plugin import (
    ComponentConfig,
    LoadedModel,
    NonNegativeFloat,
    Plan,
    PositiveInt,
    StepContext,
    StrictModel,
    forward,
    hookimpl,
)
from headlab.plugins.detectors.activation_patching import (
    Direction,
    Metric,
    PairRuns,
    metric_of,
    normalised_score,
    pair_chunks,
    pair_inputs,
    pair_runs,
)
from headlab.plugins.detectors.norms import AffineNorm, affine_norm
from headlab.plugins.detectors.ov_circuit import POST_ATTENTION_NORMS, model_type
from headlab.resources import Estimate, EstimateContext

__all__ = [
    "BlockParts", "Circuit", "EdgeAttribution", "EdgeGraph", "EdgeRuns", "block_parts", "detect", "edge_graph",
    "edge_scores", "memory_per_token", "patch_circuit", "record", "select_circuit",
]

CONVENTION = ("score(u -> v) = sum over positions of (a_u(other) - a_u(base)) . d metric / d (input of v) at the "
              "base run, mean over examples; base: clean to noise, corrupt to denoise; estimates m(base with the "
              "edge patched to the other run's value) - m(base)")
FAITHFULNESS = ("faithfulness = mean circuit metric / mean clean metric; faithfulness_normalised = (mean circuit - "
                "mean corrupt) / (mean clean - mean corrupt); circuit: one clean forward, edges outside the "
                "circuit carry the corrupted source value")


class Circuit(StrictModel):
    """The edges kept as the circuit: the ``top`` edges by ``|score|``, or those with ``|score| >= threshold``."""

    top: PositiveInt | None = Field(None, description="keep the edges with the largest |score|")
    threshold: NonNegativeFloat | None = Field(None, description="keep the edges with |score| >= threshold")

    @model_validator(mode="after")
    def _one(self) -> Circuit:
        if (self.top is None) == (self.threshold is None):
            raise ValueError("circuit: give exactly one of top (a number of edges) or threshold (a |score|)")
        return self


class EdgeAttribution(ComponentConfig):
    """Edge attribution patching (EAP, EAP-IG) over the graph of embeddings, heads, MLPs and logits; optionally
    a circuit of the top edges, patched exactly, and its faithfulness."""

    kind: Literal["edge_attribution"] = "edge_attribution"
    metric: Metric = Field("logit_diff", description="logit[answer] - logit[wrong], or the answer's log-probability")
    direction: Direction = Field("noise", description="noise: gradient on the clean run, corrupt - clean "
                                 "(published EAP); denoise: the reverse")
    method: Literal["eap", "eap_ig"] = Field("eap", description="eap: one gradient; eap_ig: gradients averaged "
                                             "over ig_steps interpolated inputs")
    ig_steps: PositiveInt = Field(5, description="eap_ig: interpolation steps between the two inputs")
    circuit: Circuit | None = Field(None, description="{top: k} or {threshold: t}: patch that circuit exactly")
    pair_batch_size: PositiveInt = Field(8, description="pairs per forward and backward")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of the forward over the clean and corrupted prompts of a chunk, kept for the backward."""
        return [ctx.activations(ctx.task.tokens, ctx.rows(2 * self.pair_batch_size))]


# --------------------------------------------------------------------------- the graph
@dataclass(frozen=True)
class EdgeGraph:
    """The nodes and edges of a model's graph (module docstring). Sources in order: ``emb``, then per layer
    its heads and its MLP; destinations: per layer the heads' ``q``, the key/value heads' ``k``, then ``v``, the
    MLP, then ``logits``. ``valid`` (source, destination) marks the edges."""

    n_layers: int
    n_heads: int
    n_kv_heads: int

    @property
    def block(self) -> int:
        """Destinations per layer: ``H`` queries, ``K`` keys, ``K`` values and the MLP."""
        return self.n_heads + 2 * self.n_kv_heads + 1

    def head_source(self, layer: int, head: int = 0) -> int:
        """The source index of head ``(layer, head)``."""
        return 1 + layer * (self.n_heads + 1) + head

    def mlp_source(self, layer: int) -> int:
        """The source index of the MLP of ``layer``."""
        return 1 + layer * (self.n_heads + 1) + self.n_heads

    def attention_destinations(self, layer: int) -> slice:
        """The destination indices of layer ``layer``'s queries, keys and values, in that order."""
        return slice(layer * self.block, layer * self.block + self.block - 1)

    def mlp_destination(self, layer: int) -> int:
        """The destination index of the MLP of ``layer``."""
        return layer * self.block + self.block - 1

    @property
    def logits(self) -> int:
        """The destination index of the logits."""
        return self.n_layers * self.block

    @property
    def sources(self) -> list[str]:
        """Source names, in index order."""
        out = ["emb"]
        for layer in range(self.n_layers):
            out += [f"a{layer}.h{h}" for h in range(self.n_heads)] + [f"m{layer}"]
        return out

    @property
    def destinations(self) -> list[str]:
        """Destination names, in index order."""
        out = []
        for layer in range(self.n_layers):
            out += [f"a{layer}.h{h}.q" for h in range(self.n_heads)]
            out += [f"a{layer}.kv{j}.k" for j in range(self.n_kv_heads)]
            out += [f"a{layer}.kv{j}.v" for j in range(self.n_kv_heads)]
            out.append(f"m{layer}")
        return [*out, "logits"]

    @property
    def valid(self) -> np.ndarray:
        """(source, destination) bool: the source runs before the destination in the block order."""
        src = [-1] + [t for layer in range(self.n_layers) for t in [2 * layer] * self.n_heads + [2 * layer + 1]]
        dst = [t for layer in range(self.n_layers) for t in [2 * layer] * (self.block - 1) + [2 * layer + 1]]
        return np.asarray(src)[:, None] < np.asarray([*dst, 2 * self.n_layers])[None, :]

    @property
    def edges(self) -> tuple[np.ndarray, np.ndarray]:
        """(source indices, destination indices) of every edge, source-major."""
        s, d = np.nonzero(self.valid)
        return s, d


def edge_graph(n_layers: int, n_heads: int, n_kv_heads: int) -> EdgeGraph:
    """The graph of a model with these numbers of layers, query heads and key/value heads."""
    if n_heads % n_kv_heads:
        raise ValueError(f"edge_graph: {n_heads} query heads are not a multiple of {n_kv_heads} key/value heads")
    return EdgeGraph(int(n_layers), int(n_heads), int(n_kv_heads))


# --------------------------------------------------------------------------- the modules of a block
@dataclass(frozen=True)
class BlockParts:
    """The modules of one decoder layer the graph hooks: the attention's input norm, the projections whose
    outputs hold the queries, keys and values (``(module, parts)``, the parts ``"q"``, ``"k"``, ``"v"`` in the
    order the module's output holds them), the output projection (its input is every head's ``z``), the MLP and
    the MLP's input norm."""

    norm: torch.nn.Module
    projections: tuple[tuple[torch.nn.Module, tuple[str, ...]], ...]
    out: torch.nn.Module
    mlp: torch.nn.Module
    mlp_norm: torch.nn.Module


def _child(module: torch.nn.Module, *names: str) -> torch.nn.Module | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, torch.nn.Module):
            return child
    return None


def block_parts(lm: LoadedModel, layer: int) -> BlockParts:
    """The hooked modules of decoder layer ``layer``; a ValueError naming the architecture where the graph does
    not apply (the attention output normalised before the residual stream) or a module is missing."""
    kind = model_type(lm)
    if kind in POST_ATTENTION_NORMS:
        raise ValueError(f"edge_attribution: {kind} normalises each attention output before the residual stream "
                         "(post_attention_layernorm), so a head's contribution is not z W_O and the edges of the "
                         "graph are not additive; use a pre-norm model (llama, mistral, qwen2, gpt2, phi3)")
    attn, block, norm = lm.attention_module(layer), lm.decoder_layers[layer], lm.input_norm(layer)
    if all(_child(attn, n) is not None for n in ("q_proj", "k_proj", "v_proj")):
        projections = ((attn.q_proj, ("q",)), (attn.k_proj, ("k",)), (attn.v_proj, ("v",)))
    else:
        fused = _child(attn, "qkv_proj", "c_attn")
        projections = () if fused is None else ((fused, ("q", "k", "v")),)
    out, mlp = _child(attn, "o_proj", "c_proj"), _child(block, "mlp")
    mlp_norm = _child(block, "post_attention_layernorm", "ln_2")
    if norm is None or not projections or out is None or mlp is None or mlp_norm is None:
        raise ValueError(f"edge_attribution: layer {layer} of this {kind} model lacks a module the graph hooks "
                         "(attention input norm, q/k/v projections, output projection, MLP, MLP input norm)")
    return BlockParts(norm, projections, out, mlp, mlp_norm)


# --------------------------------------------------------------------------- recording the two runs
@dataclass
class EdgeRuns:
    """A chunk of pairs run once, clean and corrupted (:class:`PairRuns`: rows ``0..n-1`` clean, ``n..2n-1``
    corrupted, ``z`` every head's output), with every MLP's output ``mlp`` (2n, layer, T, d_model) and the
    embeddings ``emb`` (2n, T, d_model), the residual stream entering layer 0."""

    pairs: PairRuns
    mlp: Tensor
    emb: Tensor

    def rows(self, which: str) -> slice:
        """The rows of the ``clean`` or ``corrupt`` prompts."""
        return self.pairs.rows(which)

    def real(self) -> Tensor:
        """(pair, T) 1.0 at a pair's tokens, 0.0 at its left padding."""
        return self.pairs.mask[: self.pairs.n].to(self.emb.device, torch.float32)


def record(lm: LoadedModel, examples: list, answer: list[int], wrong: list[int], metric: str) -> EdgeRuns:
    """One forward over the clean and corrupted prompts of ``examples`` recording every source's output."""
    L = lm.geometry.n_layers
    parts = [block_parts(lm, layer) for layer in range(L)]
    mlp: dict[int, Tensor] = {}
    emb: list[Tensor] = []
    handles: list = []
    with ExitStack() as stack:
        stack.callback(_remove, handles)
        handles.append(parts[0].norm.register_forward_pre_hook(lambda m, args: emb.append(args[0].detach())))
        for layer, p in enumerate(parts):
            handles.append(p.mlp.register_forward_hook(
                lambda m, args, out, layer=layer: mlp.__setitem__(layer, out.detach())))
        runs = pair_runs(lm, examples, answer, wrong, metric)
    return EdgeRuns(runs, torch.stack([mlp[layer] for layer in range(L)], dim=1), emb[0])


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _compute_dtype(lm: LoadedModel) -> torch.dtype:
    dtype = next(lm.model.parameters()).dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _Deltas:
    """``other - base`` of every source, zero at padding: ``z`` (pair, layer, T, head, head_dim), ``mlp`` (pair,
    layer, T, d_model), ``emb`` (pair, T, d_model)."""

    z: Tensor
    mlp: Tensor
    emb: Tensor


def _deltas(runs: EdgeRuns, base: str, other: str) -> _Deltas:
    real = runs.real()
    pz = runs.pairs.z.to(runs.emb.device)
    dz = (pz[runs.rows(other)] - pz[runs.rows(base)]).permute(0, 1, 3, 2, 4)
    dz = dz * real[:, None, :, None, None].to(dz.dtype)
    dmlp = (runs.mlp[runs.rows(other)] - runs.mlp[runs.rows(base)]) * real[:, None, :, None].to(runs.mlp.dtype)
    demb = (runs.emb[runs.rows(other)] - runs.emb[runs.rows(base)]) * real[:, :, None].to(runs.emb.dtype)
    return _Deltas(dz, dmlp, demb)


# --------------------------------------------------------------------------- gradients
@dataclass
class _Gradients:
    """One backward's gradients: ``x[l]`` the attention norm's input (pair, T, d_model); ``q[l]`` (pair, T, H,
    head_dim), ``k[l]`` / ``v[l]`` (pair, T, K, head_dim) at the projections' outputs; ``mlp[l]`` and ``logits``
    (pair, T, d_model) at the MLP norm's and the final norm's inputs."""

    x: dict[int, Tensor] = field(default_factory=dict)
    q: dict[int, Tensor] = field(default_factory=dict)
    k: dict[int, Tensor] = field(default_factory=dict)
    v: dict[int, Tensor] = field(default_factory=dict)
    mlp: dict[int, Tensor] = field(default_factory=dict)
    logits: Tensor | None = None


def _split(t: Tensor, parts: tuple[str, ...], H: int, K: int, D: int) -> dict[str, Tensor]:
    """A projection output (pair, T, width) as its ``q`` (pair, T, H, D) / ``k`` / ``v`` (pair, T, K, D) parts."""
    sizes = {"q": H * D, "k": K * D, "v": K * D}
    chunks = t.split([sizes[p] for p in parts], dim=-1)
    return {p: c.unflatten(-1, (sizes[p] // D, D)) for p, c in zip(parts, chunks, strict=True)}


def _gradients(lm: LoadedModel, parts: list[BlockParts], ids: Tensor, mask: Tensor, answer: Tensor, wrong: Tensor,
               metric: str, embeds: Callable[[Tensor], Tensor] | None = None) -> _Gradients:
    """The gradients of one forward and backward over ``ids`` (``embeds``: a function replacing the input
    embeddings)."""
    geo = lm.geometry
    H, K, D = geo.n_heads, geo.n_kv_heads, geo.head_dim
    out = _Gradients()
    leaves: dict[tuple[str, int], Tensor] = {}

    def leaf_like(key: tuple[str, int], t: Tensor) -> Tensor:
        leaves[key] = torch.zeros_like(t, requires_grad=True)
        return leaves[key]

    handles: list = []
    with ExitStack() as stack:
        stack.callback(_remove, handles)
        if embeds is not None:
            handles.append(lm.model.get_input_embeddings().register_forward_hook(lambda m, a, o: embeds(o)))
        for layer, p in enumerate(parts):
            handles.append(p.norm.register_forward_pre_hook(
                lambda m, args, layer=layer: out.x.__setitem__(layer, args[0].detach())))
            for i, (module, _) in enumerate(p.projections):
                handles.append(module.register_forward_hook(
                    lambda m, args, o, key=(f"proj{i}", layer): o + leaf_like(key, o)))
            handles.append(p.mlp_norm.register_forward_pre_hook(
                lambda m, args, layer=layer: (args[0] + leaf_like(("mlp", layer), args[0]), *args[1:])))
        handles.append(lm.final_norm.register_forward_pre_hook(
            lambda m, args: (args[0] + leaf_like(("logits", 0), args[0]), *args[1:])))
        with torch.enable_grad():
            res, _ = forward(lm, ids, Plan(), attention_mask=mask, grad=True, logits_to_keep=1)
            m = metric_of(res.logits[:, -1], answer, wrong, metric)
            keys = list(leaves)
            grads = torch.autograd.grad(m.sum(), [leaves[k] for k in keys], allow_unused=True)
    for key, g in zip(keys, grads, strict=True):
        g = torch.zeros_like(leaves[key]) if g is None else g
        name, layer = key
        if name == "mlp":
            out.mlp[layer] = g
        elif name == "logits":
            out.logits = g
        else:
            module_parts = parts[layer].projections[int(name[4:])][1]
            for part, t in _split(g, module_parts, H, K, D).items():
                getattr(out, part)[layer] = t
    return out


#: source heads projected through ``W_O`` together: that transient is at most this many d_model vectors per token
HEAD_BLOCK = 8


def _norm_vjp(rule: AffineNorm, x: Tensor, out: Tensor) -> Tensor:
    """``J^T c`` for each cotangent ``c`` of ``out`` (n, pair, T, d_model), computed in place, ``J`` the Jacobian
    at ``x`` (pair, T, d_model) of the norm ``y = centre(x) / s(x) * g`` (``rule``): with ``w = g c`` and ``x^ =
    centre(x) / s``, ``J^T c = centre((w - x^ mean(w x^)) / s)``."""
    xd = x.to(out.dtype)
    scale = rule.scale(xd)
    unit = rule.centred(xd) / scale
    out.mul_(rule.gain.to(out.device, out.dtype))
    along = torch.stack([(row * unit).mean(-1) for row in out])  # (n, pair, T); a row at a time: no copy of out
    out.addcmul_(unit.unsqueeze(0), along.unsqueeze(-1), value=-1.0)
    out.div_(scale.unsqueeze(0))
    if rule.centre:
        out.sub_(out.mean(-1, keepdim=True))
    return out


def _destination_gradients(lm: LoadedModel, rules: list[AffineNorm], grads: _Gradients, layer: int,
                           dtype: torch.dtype) -> Tensor:
    """(H + 2K, pair, T, d_model): d metric / d (pre-norm input) of layer ``layer``'s query, key and value
    destinations, in destination order (``rules``: each layer's attention norm)."""
    hw = lm.head_weights(layer)
    x = grads.x[layer]
    H, K = int(hw.W_Q.shape[0]), int(hw.W_K.shape[0])
    out = torch.empty((H + 2 * K, *x.shape), dtype=dtype, device=x.device)
    for offset, g, W in ((0, grads.q[layer], hw.W_Q), (H, grads.k[layer], hw.W_K), (H + K, grads.v[layer], hw.W_V)):
        for h in range(int(W.shape[0])):  # one head at a time into its row: no second copy of all the rows
            torch.matmul(g[:, :, h].to(dtype), W[h].T.to(dtype), out=out[offset + h])
    return _norm_vjp(rules[layer], x, out)


def _step_scores(lm: LoadedModel, rules: list[AffineNorm], graph: EdgeGraph, grads: _Gradients, delta: _Deltas,
                 dtype: torch.dtype) -> Tensor:
    """(source, destination) float64: the sums over pairs and positions of ``delta . gradient`` of one step."""
    L, H = graph.n_layers, graph.n_heads
    S = torch.zeros(len(graph.sources), len(graph.destinations), dtype=torch.float64)
    W_O = [lm.head_weights(layer).W_O.to(dtype) for layer in range(L)]
    demb = delta.emb.to(dtype)
    for layer in range(L + 1):
        G = flat = None  # the last layer's destination gradients are freed before this layer's are made
        if layer < L:
            G = _destination_gradients(lm, rules, grads, layer, dtype)  # (n_att, pair, T, d)
            cols = graph.attention_destinations(layer)
            post, post_col = grads.mlp[layer].to(dtype), graph.mlp_destination(layer)
            flat = G.flatten(1)  # (n_att, pair * T * d): the contractions below are matrix products on this view
            S[0, cols] += (flat @ demb.flatten()).double().cpu()
        else:
            post, post_col = grads.logits.to(dtype), graph.logits
        S[0, post_col] += float((demb * post).sum())
        for src in range(min(layer + 1, L)):
            dz = delta.z[:, src].to(dtype)
            for h0 in range(0, H, HEAD_BLOCK):
                heads = slice(h0, min(h0 + HEAD_BLOCK, H))
                a = torch.einsum("nthe,hed->hntd", dz[:, :, heads], W_O[src][heads])
                rows = slice(graph.head_source(src, h0), graph.head_source(src, heads.stop - 1) + 1)
                S[rows, post_col] += (a.flatten(1) @ post.flatten()).double().cpu()
                if src < layer and flat is not None:
                    S[rows, cols] += (a.flatten(1) @ flat.T).double().cpu()
            if src < layer:
                dm = delta.mlp[:, src].to(dtype)
                S[graph.mlp_source(src), post_col] += float((dm * post).sum())
                if flat is not None:
                    S[graph.mlp_source(src), cols] += (flat @ dm.flatten()).double().cpu()
    return S


def edge_scores(lm: LoadedModel, runs: EdgeRuns, graph: EdgeGraph, metric: str, direction: str = "noise",
                steps: int | None = None) -> Tensor:
    """(source, destination) float64: EAP (``steps=None``) or EAP-IG over ``steps`` interpolation steps, summed
    over the chunk's pairs (module docstring; zero where there is no edge)."""
    parts = [block_parts(lm, layer) for layer in range(graph.n_layers)]
    d_model = int(lm.head_weights(0).d_model)
    rules = []
    for p in parts:
        with lm.weights_loaded(p.norm):
            rules.append(affine_norm(p.norm, d_model))
    dtype = _compute_dtype(lm)
    base, other = ("clean", "corrupt") if direction == "noise" else ("corrupt", "clean")
    delta = _deltas(runs, base, other)
    p = runs.pairs
    ids, mask = p.ids[p.rows(base)], p.mask[p.rows(base)]
    total = torch.zeros(len(graph.sources), len(graph.destinations), dtype=torch.float64)
    m = 1 if steps is None else int(steps)
    e_other = None
    if m > 1:
        embedding = lm.model.get_input_embeddings()
        with torch.no_grad(), lm.weights_loaded(embedding):
            e_other = embedding(p.ids[p.rows(other)].to(embedding.weight.device))
    for k in range(1, m + 1):
        embeds = None if k == m else partial(_interpolate, e_other, k / m)
        grads = _gradients(lm, parts, ids, mask, p.answer, p.wrong, metric, embeds)
        total += _step_scores(lm, rules, graph, grads, delta, dtype)
    return total / m


def _interpolate(start: Tensor, alpha: float, end: Tensor) -> Tensor:
    """``start + alpha (end - start)``: the base run's embeddings ``end`` moved ``alpha`` of the way from the
    other run's."""
    return start + alpha * (end - start)


def memory_per_token(lm: LoadedModel) -> dict[str, int]:
    """Bytes per token (one example's position) of what :func:`edge_scores` keeps: the activation differences
    (``z`` per head, MLP outputs, embeddings) and one step's gradients (the q/k/v projections', the MLP and
    logits destinations', the attention norms' inputs); the most it holds besides while scoring a step (one
    layer's query, key and value destination gradients and :data:`HEAD_BLOCK` heads' outputs, d_model wide, in
    the compute dtype); and EAP-IG's dense (sources, d_model) layout of the activation differences."""
    geo = lm.geometry
    L, H, K, D = geo.n_layers, geo.n_heads, geo.n_kv_heads, geo.head_dim
    d_model = int(lm.head_weights(0).d_model)
    item = next(lm.model.parameters()).element_size()
    sources = 1 + L * (H + 1)
    compute = torch.finfo(_compute_dtype(lm)).bits // 8
    return {"activation_bytes_per_token": (L * H * D + L * d_model + d_model) * item,
            "gradient_bytes_per_token": (L * (H + 2 * K) * D + 2 * L * d_model + d_model) * item,
            "transient_bytes_per_token": (H + 2 * K + min(H, HEAD_BLOCK)) * d_model * compute,
            "dense_bytes_per_token": sources * d_model * item}


# --------------------------------------------------------------------------- circuits
def select_circuit(score: np.ndarray, circuit: Circuit) -> np.ndarray:
    """(edge,) bool: the ``circuit.top`` edges with the largest ``|score|`` (ties: the earlier edge), or the
    edges with ``|score| >= circuit.threshold``."""
    magnitude = np.abs(np.asarray(score, dtype=np.float64))
    if circuit.threshold is not None:
        return magnitude >= circuit.threshold
    keep = np.zeros(magnitude.shape, dtype=bool)
    keep[np.argsort(-magnitude, kind="stable")[: circuit.top]] = True
    return keep


def patch_circuit(lm: LoadedModel, runs: EdgeRuns, graph: EdgeGraph, keep: np.ndarray, metric: str) -> Tensor:
    """The metric (pair,) float64 of one forward over the clean prompts in which only the edges marked in
    ``keep`` ((source, destination) bool; only edges count) carry the value their source has in this run; every
    other edge carries the corrupted run's value (module docstring)."""
    geo = lm.geometry
    L, H, K, D = geo.n_layers, geo.n_heads, geo.n_kv_heads, geo.head_dim
    parts = [block_parts(lm, layer) for layer in range(L)]
    dtype = _compute_dtype(lm)
    drop = torch.as_tensor(graph.valid & ~np.asarray(keep, dtype=bool), dtype=dtype)
    p = runs.pairs
    clean, corrupt = runs.rows("clean"), runs.rows("corrupt")
    device = runs.emb.device
    real = runs.real()[..., None].to(dtype)
    z_cor = p.z[corrupt].to(device).permute(0, 1, 3, 2, 4).to(dtype)  # (pair, layer, T, head, head_dim)
    mlp_cor, emb_cor = runs.mlp[corrupt].to(dtype), runs.emb[corrupt].to(dtype)
    hws = [lm.head_weights(layer) for layer in range(L)]
    state: dict = {"z": {}, "mlp": {}}

    def incoming(cols: slice | int) -> Tensor | None:
        """sum over dropped incoming edges of (this run - corrupt) source outputs, (n_cols, pair, T, d)."""
        w = drop[:, cols] if isinstance(cols, slice) else drop[:, cols:cols + 1]
        if not bool(w.any()):
            return None
        out = torch.einsum("k,ntd->kntd", w[0].to(device), state["emb"])
        for src, dz in state["z"].items():
            a = torch.einsum("nthe,hed->hntd", dz, hws[src].W_O.to(dtype))
            rows = slice(graph.head_source(src), graph.head_source(src) + H)
            out = out + torch.einsum("hk,hntd->kntd", w[rows].to(device), a)
        for src, dm in state["mlp"].items():
            out = out + w[graph.mlp_source(src)].to(device)[:, None, None, None] * dm[None]
        return out * real[None]

    def attention_inputs(layer: int, x: Tensor) -> None:
        if state.get("inside"):  # the norm run below on the destinations' inputs
            return
        if layer == 0:
            state["emb"] = x.to(dtype) - emb_cor
        state["qkv"] = None
        cols = graph.attention_destinations(layer)
        D_att = incoming(cols)
        if D_att is None:
            return
        hw = hws[layer]
        state["inside"] = True
        try:
            normed = parts[layer].norm((x.to(dtype)[None] - D_att).to(x.dtype)).to(dtype)  # (H + 2K, pair, T, d)
        finally:
            state["inside"] = False
        new = {}
        for part, W, b, sl in (("q", hw.W_Q, hw.b_Q, slice(0, H)), ("k", hw.W_K, hw.b_K, slice(H, H + K)),
                               ("v", hw.W_V, hw.b_V, slice(H + K, H + 2 * K))):
            t = torch.einsum("hntm,hme->nthe", normed[sl], W.to(dtype))
            new[part] = (t if b is None else t + b.to(dtype)[None, None], drop[:, cols][:, sl].any(0))
        state["qkv"] = new

    def projection(module_parts: tuple[str, ...], o: Tensor) -> Tensor:
        if state["qkv"] is None:
            return o
        pieces = _split(o, module_parts, H, K, D)
        for part in module_parts:
            value, which = state["qkv"][part]
            idx = which.nonzero()[:, 0].to(o.device)
            pieces[part] = pieces[part].index_copy(2, idx, value[:, :, idx.to(value.device)].to(o.dtype))
        return torch.cat([pieces[part].flatten(-2) for part in module_parts], dim=-1)

    def replace_input(cols: int, args: tuple) -> tuple:
        d = incoming(cols)
        if d is None:
            return args
        return ((args[0].to(dtype) - d[0]).to(args[0].dtype), *args[1:])

    handles: list = []
    with ExitStack() as stack:
        stack.callback(_remove, handles)
        for layer, part in enumerate(parts):
            handles.append(part.norm.register_forward_pre_hook(
                lambda m, args, layer=layer: attention_inputs(layer, args[0])))
            for module, module_parts in part.projections:
                handles.append(module.register_forward_hook(
                    lambda m, args, o, module_parts=module_parts: projection(module_parts, o)))
            handles.append(part.out.register_forward_pre_hook(
                lambda m, args, layer=layer: state["z"].__setitem__(
                    layer, args[0].unflatten(-1, (H, D)).to(dtype) - z_cor[:, layer])))
            handles.append(part.mlp_norm.register_forward_pre_hook(
                lambda m, args, layer=layer: replace_input(graph.mlp_destination(layer), args)))
            handles.append(part.mlp.register_forward_hook(
                lambda m, args, o, layer=layer: state["mlp"].__setitem__(layer, o.to(dtype) - mlp_cor[:, layer])))
        handles.append(lm.final_norm.register_forward_pre_hook(lambda m, args: replace_input(graph.logits, args)))
        res, _ = forward(lm, p.ids[clean], Plan(), attention_mask=p.mask[clean], logits_to_keep=1)
    return metric_of(res.logits[:, -1], p.answer, p.wrong, metric)


# --------------------------------------------------------------------------- the detector
def detect(config: EdgeAttribution, ctx: StepContext) -> xr.Dataset:
    """The ``edge_attribution`` detector over a pair task."""
    lm = ctx.model
    geo = lm.geometry
    graph = edge_graph(geo.n_layers, geo.n_heads, geo.n_kv_heads)
    block_parts(lm, 0)  # an unsupported architecture is refused before any forward
    answer, wrong = pair_inputs(ctx.examples, config.kind)
    n = len(ctx.examples)
    chunks = pair_chunks(n, config.pair_batch_size)
    clean, corrupt = np.zeros(n), np.zeros(n)
    total = torch.zeros(len(graph.sources), len(graph.destinations), dtype=torch.float64)
    steps = config.ig_steps if config.method == "eap_ig" else None

    def chunk_runs(idx: list[int]) -> EdgeRuns:
        return record(lm, [ctx.examples[i] for i in idx], [answer[i] for i in idx], [wrong[i] for i in idx],
                      config.metric)

    for idx in ctx.progress(chunks, "edge attribution"):
        runs = chunk_runs(idx)
        m = runs.pairs.metric.detach().cpu().numpy()
        clean[idx], corrupt[idx] = m[:len(idx)], m[len(idx):]
        total += edge_scores(lm, runs, graph, config.metric, config.direction, steps)
    src, dst = graph.edges
    score = (total / n).numpy()[src, dst]
    sources, destinations = np.asarray(graph.sources), np.asarray(graph.destinations)
    ds = xr.Dataset(
        {"score": ("edge", score), "clean": ("example", clean), "corrupt": ("example", corrupt)},
        coords={"source": ("edge", sources[src]), "destination": ("edge", destinations[dst])})
    ds.attrs.update(method="edge_attribution", estimator=config.method, model=lm.name, metric=config.metric,
                    direction=config.direction, convention=CONVENTION, position="last",
                    n_edges=int(len(score)), reference="docs/methods.md#edge-attribution",
                    **memory_per_token(lm))
    if config.method == "eap_ig":
        ds.attrs["ig_steps"] = config.ig_steps
    if config.circuit is None:
        return ds
    keep = select_circuit(score, config.circuit)
    keep_matrix = np.zeros(graph.valid.shape, dtype=bool)
    keep_matrix[src[keep], dst[keep]] = True
    patched = np.zeros(n)
    for idx in ctx.progress(chunks, "edge patching"):
        patched[idx] = patch_circuit(lm, chunk_runs(idx), graph, keep_matrix, config.metric).cpu().numpy()
    normalised = float(normalised_score(patched, clean, corrupt, "means", config.kind))
    with np.errstate(divide="ignore", invalid="ignore"):
        faithfulness = float(np.float64(patched.mean()) / np.float64(clean.mean()))
    ds["in_circuit"] = ("edge", keep)
    ds["circuit"] = ("example", patched)
    ds.attrs.update(faithfulness=faithfulness, faithfulness_normalised=normalised, circuit_edges=int(keep.sum()),
                    circuit_selection=(f"top {config.circuit.top} by |score|" if config.circuit.top is not None
                                       else f"|score| >= {config.circuit.threshold}"),
                    faithfulness_convention=FAITHFULNESS)
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(EdgeAttribution, detect)
