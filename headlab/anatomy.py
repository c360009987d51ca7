"""Model anatomy: the modules and per-head weights of a loaded language model, one API for every architecture.

Plugins reach the parts of a model through these functions (or the methods of
:class:`headlab.model.LoadedModel` that call them) instead of walking ``model.model.layers`` or
``model.transformer.h`` and slicing projections by hand. Supported text architectures: ``llama``,
``mistral``, ``qwen2``, ``gemma2``, ``gpt2``, ``olmo2``, ``phi3``; of vision-language models, the text tower of
``llava`` (whatever its text architecture, if it is one of those) and ``qwen2_vl``. Any other model type is an
:class:`AnatomyError` naming it.

Head weights follow TransformerLens' names and orientation (``x @ W``, row vectors):

- ``W_Q`` (head, d_model, d_head), ``W_K`` / ``W_V`` (kv_head, d_model, d_head), ``W_O`` (head, d_head, d_model);
- ``b_Q`` (head, d_head), ``b_K`` / ``b_V`` (kv_head, d_head), ``b_O`` (d_model,), or ``None`` where the
  architecture has no such bias;
- ``kv_head_of[h]``: the key/value head that query head ``h`` reads (grouped-query attention).

``x @ W_Q[h] + b_Q[h]`` is head ``h``'s slice of the query projection of the normed input ``x`` and
``sum_h z[h] @ W_O[h] + b_O`` is the output projection of the head outputs ``z``. What the weights do not
include, and a forward must add:

- rotary position embeddings (applied to queries and keys after the projection);
- the query/key norms of olmo2: RMS norms over the whole projection of all heads, before RoPE
  (:func:`query_key_norms`); per-head q/k norms (qwen3 / gemma3 style) belong to unsupported architectures;
- the attention scale (:attr:`HeadWeights.scale`: gemma2's ``query_pre_attn_scalar ** -0.5``, gpt2's
  inverse-layer scaling) and gemma2's attention logit soft-capping (:attr:`HeadWeights.softcap`);
- sliding-window masks, and the residual-stream norms around the attention (gemma2's
  ``post_attention_layernorm``, olmo2's post-norms).

The weights are detached views of the model's parameters: no copy, no autograd; writing into them edits the
model. A model placed by a ``device_map`` that offloads modules through accelerate (to ``disk``, or to the CPU
beside an accelerator) keeps an offloaded module's parameters on the ``meta`` device between forwards; the
functions that return weights then load that module's weights (that module's only, never the whole model)
through accelerate's offload hooks onto the device the module computes on, the same values as the unsplit
model's, and drop them from the module again: there they are tensors read for the call (writing into them
is not supported: whether it reaches the offloaded weights depends on where accelerate keeps them). The
modules the functions return (norms, attention) are the model's own; :func:`weights_loaded` makes an
offloaded module's parameters readable and the module callable outside a forward of the model.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

import torch
from torch import Tensor

from .geometry import geometry_of

__all__ = [
    "SUPPORTED_MODEL_TYPES", "AnatomyError", "HeadWeights", "attention_module", "decoder_layers", "embedding",
    "final_norm", "head_weights", "input_norm", "position_embedding", "query_key_norms", "text_model",
    "unembed", "unembedding", "unembedding_bias", "weights_loaded",
]


class AnatomyError(ValueError):
    """The model's architecture is not one whose parts headlab knows, or a part it expects is missing."""


@dataclass(frozen=True)
class _Layout:
    """Where one text architecture keeps its parts (attribute paths) and how its projections are stored."""

    base: str  # the text model inside the *ForCausalLM wrapper
    layers: str
    attention: str
    input_norm: str | None  # None: the attention reads the residual stream itself (post-norm)
    final_norm: str
    embedding: str
    qkv: Literal["separate", "fused", "conv1d"]
    out: str
    position_embedding: str | None = None
    qk_norm: bool = False


_LLAMA = _Layout(base="model", layers="layers", attention="self_attn", input_norm="input_layernorm",
                 final_norm="norm", embedding="embed_tokens", qkv="separate", out="o_proj")
_LAYOUTS: dict[str, _Layout] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen2_vl_text": _LLAMA,
    "gemma2": _LLAMA,
    "olmo2": _Layout(base="model", layers="layers", attention="self_attn", input_norm=None, final_norm="norm",
                     embedding="embed_tokens", qkv="separate", out="o_proj", qk_norm=True),
    "phi3": _Layout(base="model", layers="layers", attention="self_attn", input_norm="input_layernorm",
                    final_norm="norm", embedding="embed_tokens", qkv="fused", out="o_proj"),
    "gpt2": _Layout(base="transformer", layers="h", attention="attn", input_norm="ln_1", final_norm="ln_f",
                    embedding="wte", qkv="conv1d", out="c_proj", position_embedding="wpe"),
}
#: vision-language models: where the text tower sits in the ``*ForConditionalGeneration`` model, then in its base
_VISION_WRAPPERS: dict[str, tuple[str, ...]] = {"llava": ("model.language_model", "language_model"),
                                                "qwen2_vl": ("model.language_model", "language_model")}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(set(_LAYOUTS) | set(_VISION_WRAPPERS)))
"""The model types (``config.model_type``) whose anatomy headlab knows."""


@dataclass(frozen=True, eq=False)
class HeadWeights:
    """The attention weights of one layer, per head (see the module docstring for the conventions).

    ``scale`` multiplies the query-key dot products before the softmax; ``softcap``, when set, caps the scaled
    logits as ``softcap * tanh(logits / softcap)`` (gemma2). Neither is folded into the weights.
    """

    layer: int
    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor
    b_Q: Tensor | None
    b_K: Tensor | None
    b_V: Tensor | None
    b_O: Tensor | None
    kv_head_of: tuple[int, ...]
    scale: float
    softcap: float | None = None

    @property
    def n_heads(self) -> int:
        """Number of query heads."""
        return int(self.W_Q.shape[0])

    @property
    def n_kv_heads(self) -> int:
        """Number of key/value heads."""
        return int(self.W_K.shape[0])

    @property
    def d_model(self) -> int:
        """Width of the residual stream."""
        return int(self.W_Q.shape[1])

    @property
    def d_head(self) -> int:
        """Width of one head."""
        return int(self.W_Q.shape[2])

    def per_query_head(self, t: Tensor) -> Tensor:
        """A per-kv-head tensor (``W_K``, ``W_V``, ``b_K``, ``b_V``: kv_head first) repeated to one entry per
        query head, in query-head order."""
        if t.shape[0] != self.n_kv_heads:
            raise ValueError(f"per_query_head: expected {self.n_kv_heads} kv heads on dim 0, got {tuple(t.shape)}")
        return t[torch.tensor(self.kv_head_of, device=t.device)]


# --------------------------------------------------------------------------- locating the parts
def _model_type(model: Any) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__)


def _text_type(model: Any) -> str:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return str(getattr(text, "model_type", "") or "")


def _layout(model: Any) -> _Layout:
    outer = _model_type(model)
    if outer not in _LAYOUTS and outer not in _VISION_WRAPPERS:
        raise AnatomyError(f"headlab.anatomy: model type {outer!r} ({type(model).__name__}) is not supported: its "
                           f"layers and projections are not known (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    text = _text_type(model) if outer in _VISION_WRAPPERS else outer
    if text not in _LAYOUTS:
        raise AnatomyError(f"headlab.anatomy: the text tower of this {outer} model is a {text!r} model, whose "
                           f"layers and projections are not known (supported: {', '.join(sorted(_LAYOUTS))})")
    return _LAYOUTS[text]


def _path(root: Any, path: str, model: Any) -> Any:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise AnatomyError(f"headlab.anatomy: this {_model_type(model)} model ({type(model).__name__}) has "
                               f"no {path!r} module where its architecture keeps one")
    return obj


def text_model(model: Any) -> torch.nn.Module:
    """The text decoder inside ``model`` (e.g. ``LlamaModel``, GPT-2's ``transformer``, a VLM's language model):
    the module that holds the embedding, the decoder layers, the final norm and the rotary embedding."""
    layout = _layout(model)
    if hasattr(model, layout.layers) and hasattr(model, layout.final_norm):
        return model  # already the text decoder (a base model without the LM head)
    paths = _VISION_WRAPPERS.get(_model_type(model), (layout.base,))
    for path in paths[:-1]:
        try:
            return _path(model, path, model)
        except AnatomyError:
            continue
    return _path(model, paths[-1], model)


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layer modules of the language model, in order."""
    layout = _layout(model)
    return list(_path(text_model(model), layout.layers, model))


def _layer(model: Any, layer: int) -> torch.nn.Module:
    layers = decoder_layers(model)
    index = operator.index(layer)
    if not 0 <= index < len(layers):
        raise IndexError(f"layer {layer!r} is out of range: the model has {len(layers)} layers (0..{len(layers) - 1})")
    return layers[index]


def attention_module(model: Any, layer: int) -> torch.nn.Module:
    """The self-attention module of decoder layer ``layer`` (the one that owns the projections)."""
    return _path(_layer(model, layer), _layout(model).attention, model)


def input_norm(model: Any, layer: int) -> torch.nn.Module | None:
    """The norm that feeds the attention of decoder layer ``layer``; ``None`` where the attention reads the
    residual stream directly (olmo2 normalises after the attention instead)."""
    layout = _layout(model)
    block = _layer(model, layer)
    return None if layout.input_norm is None else _path(block, layout.input_norm, model)


def query_key_norms(model: Any, layer: int) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(q_norm, k_norm)`` of layer ``layer`` where the architecture normalises queries and keys (olmo2: RMS
    norms over the concatenated projection of all heads, applied before RoPE), else ``None``."""
    if not _layout(model).qk_norm:
        return None
    attn = attention_module(model, layer)
    return _path(attn, "q_norm", model), _path(attn, "k_norm", model)


def final_norm(model: Any) -> torch.nn.Module:
    """The norm applied to the last hidden state before the unembedding."""
    return _path(text_model(model), _layout(model).final_norm, model)


def _embedding_module(model: Any) -> torch.nn.Module:
    return _path(text_model(model), _layout(model).embedding, model)


def embedding(model: Any) -> Tensor:
    """The input token embedding matrix ``W_E`` (vocab, d_model), a detached view. Gemma2's embedding module
    multiplies the rows it looks up by ``sqrt(d_model)`` (its ``embed_scale``); the matrix does not."""
    module = _embedding_module(model)
    with weights_loaded(model, module):
        return module.weight.detach()


def position_embedding(model: Any) -> Tensor | None:
    """The learned position embedding matrix ``W_pos`` (positions, d_model) of gpt2; ``None`` for models with
    rotary position embeddings."""
    layout = _layout(model)
    if layout.position_embedding is None:
        return None
    module = _path(text_model(model), layout.position_embedding, model)
    with weights_loaded(model, module):
        return module.weight.detach()


def _lm_head(model: Any) -> torch.nn.Module:
    _layout(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise AnatomyError(f"headlab.anatomy: this {_model_type(model)} model ({type(model).__name__}) has no "
                           "language-model head (load it as a causal or image-text-to-text LM)")
    return head


def unembedding(model: Any) -> Tensor:
    """The unembedding ``W_U`` (d_model, vocab): ``final_norm(h) @ W_U + b_U`` are the logits (before gemma2's
    final soft-capping, which :func:`unembed` applies). A detached view, transposed: tied models share
    the storage of :func:`embedding`."""
    head = _lm_head(model)
    with weights_loaded(model, head):
        return head.weight.detach().T


def unembedding_bias(model: Any) -> Tensor | None:
    """The unembedding bias ``b_U`` (vocab,), or ``None`` (none of the supported architectures has one)."""
    head = _lm_head(model)
    with weights_loaded(model, head):
        bias = getattr(head, "bias", None)
        return None if bias is None else bias.detach()


def _final_softcap(model: Any) -> float | None:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    return None if cap is None else float(cap)


def unembed(model: Any, hidden: Tensor, *, norm: bool = True) -> Tensor:
    """Logits of hidden states ``hidden`` (..., d_model), as the model's own head computes them from its last
    hidden state: the final norm (unless ``norm=False``), ``@ W_U + b_U``, then gemma2's soft-capping."""
    if norm:
        module = final_norm(model)
        with weights_loaded(model, module):
            hidden = module(hidden)
    logits = hidden @ unembedding(model).to(hidden.device, hidden.dtype)
    bias = unembedding_bias(model)
    if bias is not None:
        logits = logits + bias.to(logits.device, logits.dtype)
    cap = _final_softcap(model)
    return logits if cap is None else cap * torch.tanh(logits / cap)


# --------------------------------------------------------------------------- head weights
def _linear_weight(module: torch.nn.Module, conv1d: bool) -> Tensor:
    """A projection's weight as ``nn.Linear`` stores it, (out, in); GPT-2's ``Conv1D`` stores (in, out)."""
    weight = module.weight.detach()
    return weight.T if conv1d else weight


def _qkv_blocks(attn: torch.nn.Module, layout: _Layout, sizes: list[int],
                model: Any) -> list[tuple[Tensor, Tensor | None]]:
    """``(weight (out, d_model), bias (out,) or None)`` of the query, key and value projections, views of the
    separate or fused parameters."""
    if layout.qkv == "separate":
        projs = [_path(attn, name, model) for name in ("q_proj", "k_proj", "v_proj")]
        return [(p.weight.detach(), None if p.bias is None else p.bias.detach()) for p in projs]
    fused = _path(attn, "qkv_proj" if layout.qkv == "fused" else "c_attn", model)
    weight = _linear_weight(fused, layout.qkv == "conv1d")
    bias = None if fused.bias is None else fused.bias.detach()
    if weight.shape[0] != sum(sizes):
        return [(weight, bias)]  # reported as a geometry mismatch by the caller
    bounds = [sum(sizes[:i]) for i in range(4)]
    return [(weight[s:e], None if bias is None else bias[s:e]) for s, e in pairwise(bounds)]


def head_weights(model: Any, layer: int) -> HeadWeights:
    """The per-head attention weights of decoder layer ``layer`` (see the module docstring)."""
    attn = attention_module(model, layer)
    with weights_loaded(model, attn):
        return _head_weights(model, layer, attn)


def _head_weights(model: Any, layer: int, attn: torch.nn.Module) -> HeadWeights:
    layout = _layout(model)
    geo = geometry_of(model)
    H, K, D = geo.n_heads, geo.n_kv_heads, geo.head_dim
    counts = [H, K, K]
    blocks = _qkv_blocks(attn, layout, [n * D for n in counts], model)
    out = _path(attn, layout.out, model)
    w_out = _linear_weight(out, layout.qkv == "conv1d")
    d_model = int(w_out.shape[0])
    if (H % K or len(blocks) != 3 or w_out.shape[1] != H * D
            or any(tuple(w.shape) != (n * D, d_model) for (w, _), n in zip(blocks, counts, strict=True))):
        raise AnatomyError(f"headlab.anatomy: the projections of layer {layer} of this {_model_type(model)} model "
                           f"do not match its geometry ({H} heads, {K} kv heads, head_dim {D}, d_model {d_model})")
    (wq, bq), (wk, bk), (wv, bv) = blocks
    scale = getattr(attn, "scaling", None)
    cap = getattr(attn, "attn_logit_softcapping", None)
    return HeadWeights(
        layer=operator.index(layer),
        W_Q=_rows_to_heads(wq, H, D), W_K=_rows_to_heads(wk, K, D), W_V=_rows_to_heads(wv, K, D),
        W_O=w_out.T.reshape(H, D, d_model),
        b_Q=_bias_heads(bq, H, D), b_K=_bias_heads(bk, K, D), b_V=_bias_heads(bv, K, D),
        b_O=None if out.bias is None else out.bias.detach(),
        kv_head_of=tuple(h // (H // K) for h in range(H)),
        scale=float(D ** -0.5 if scale is None else scale),
        softcap=None if cap is None else float(cap),
    )


def _rows_to_heads(weight: Tensor, n: int, d_head: int) -> Tensor:
    """A projection weight (n * d_head, d_model) as (n, d_model, d_head)."""
    return weight.reshape(n, d_head, weight.shape[-1]).transpose(1, 2)


def _bias_heads(bias: Tensor | None, n: int, d_head: int) -> Tensor | None:
    return None if bias is None else bias.reshape(n, d_head)


# --------------------------------------------------------------------------- offloaded modules
def _offloading(model: Any, module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose accelerate hooks keep parameters of ``module`` offloaded: ``module`` and its
    submodules with an offloading hook, and the ancestor whose hook loads all its submodules for its forward
    (accelerate's ``preload_module_classes``); empty where nothing of ``module`` is offloaded."""
    inner = [m for m in module.modules() if getattr(m, "_hf_hook", None) is not None]
    if not inner and getattr(model, "_hf_hook", None) is None:
        return []  # not placed by accelerate
    from accelerate.utils import has_offloaded_params

    owners = [m for m in inner if has_offloaded_params(m)]
    name = next((n for n, m in model.named_modules() if m is module), None)
    if name:
        parts = name.split(".")
        for cut in range(len(parts)):
            above = model.get_submodule(".".join(parts[:cut]))
            if has_offloaded_params(above) and above._hf_hook.place_submodules:
                owners.append(above)
    return owners


@contextlib.contextmanager
def _kept_loaded(hook: Any) -> Iterator[None]:
    """While loaded by ``align_module_device``, the module's own forwards leave its weights in place (its hook
    would otherwise load them again and drop them to ``meta`` after each call)."""
    hook.offload = False
    try:
        yield
    finally:
        hook.offload = True


@contextlib.contextmanager
def weights_loaded(model: Any, *modules: torch.nn.Module | None) -> Iterator[None]:
    """Inside the block, the parameters of ``modules`` (parts of ``model``; None is skipped) are real tensors
    on the device each module computes on, also where accelerate offloads them (to disk, or to the CPU beside an
    accelerator; between forwards they are on the ``meta`` device): their weights can be read and the modules
    called. Only these modules' weights are loaded, through accelerate's offload hooks, and they are dropped
    again when the block ends. For modules that are not offloaded it does nothing."""
    owners: dict[int, torch.nn.Module] = {}
    for module in modules:
        if module is not None:
            owners.update((id(m), m) for m in _offloading(model, module))
    if not owners:
        yield
        return
    from accelerate.utils import align_module_device

    with contextlib.ExitStack() as stack:
        for owner in owners.values():
            stack.enter_context(align_module_device(owner))
            stack.enter_context(_kept_loaded(owner._hf_hook))
        yield
