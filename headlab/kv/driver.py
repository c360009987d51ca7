"""The policy driver: :func:`kv_policy` runs a model's forwards with headwise caches and measures them.

A prefill gets a :class:`~headlab.kv.cache.HeadwiseCache` for its left-padded batch; ``prefill_chunk`` and
``question_tokens`` split a forward into several into one cache; the usage (bytes, attention paths, peak
memory) is a :class:`~headlab.kv.usage.KvUsage`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .cache import HeadwiseCache
from .errors import KvPolicyError
from .maps import HeadBudgetMap, HeadMap
from .split import running_cache, set_running_cache
from .usage import KvUsage, LiveBytes

__all__ = ["cuda_devices", "kv_policy"]


def _decoder(model: Any) -> Any:
    get = getattr(model, "get_decoder", None)
    try:
        inner = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a model without a separable decoder runs hooked at the top
        inner = None
    return inner if isinstance(inner, torch.nn.Module) else model


_CUDA_PEAK = "cuda max_memory_allocated"
_CPU_PEAK = "cpu peak live tensor bytes"
#: forward arguments :func:`kv_policy`'s ``prefill_chunk`` splits along the sequence, besides the cache
_CHUNKED = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache_position")


def _check_chunkable(head_map: HeadMap, prefill_chunk: int | None) -> None:
    if prefill_chunk is None:
        return
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise KvPolicyError(f"prefill_chunk must be a positive number of tokens, not {prefill_chunk!r}")
    if head_map.prefill == "full" and not head_map.is_full:
        raise KvPolicyError("prefill: full: a chunked prefill is not supported (a later chunk would need the full "
                            "keys of the chunks before it); prefill the prompt in one forward")


def _check_question(head_map: HeadMap, question_tokens: int) -> None:
    if isinstance(question_tokens, bool) or not isinstance(question_tokens, int) or question_tokens < 0:
        raise KvPolicyError(f"question_tokens must be a number of tokens (>= 0), not {question_tokens!r}")
    if not question_tokens or head_map.is_full:
        return
    if isinstance(head_map, HeadBudgetMap):
        raise KvPolicyError("headkv: question_tokens is not supported (its prefill selects each KV head's keys at "
                            "the end of the whole prompt)")
    if head_map.prefill != "full":
        raise KvPolicyError(f"question_tokens {question_tokens}: the question is fed after a full prefill's "
                            "compression; with prefill: bounded every query already attends the compressed cache "
                            "(give prefill: full)")


def _question_plan(n_question: int) -> Any:
    """The split of :func:`kv_policy`'s ``question_tokens``, for :func:`_splitting`: a forward that starts without
    a cache (a prefill) runs as every row's tokens but the last ``n_question`` (the context), then those last
    ``n_question`` columns (the question: left padding makes them every row's last tokens)."""

    def plan(named: dict[str, Any], seq: torch.Tensor, positional: bool) -> list[int] | None:
        if positional:
            raise KvPolicyError("question_tokens: a forward with positional arguments after the input ids cannot be "
                                "split; pass them by name")
        if named.get("cache") is not None or named.get("past_key_values") is not None:
            return None
        mask = named.get("attention_mask")
        real = mask.sum(-1) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else \
            torch.full(seq.shape[:1], seq.shape[1], device=seq.device)
        short = torch.nonzero(real <= n_question).flatten().tolist()
        if short:
            raise KvPolicyError(f"question_tokens {n_question}: row {short[0]} of the batch has "
                                f"{int(real[short[0]])} tokens, so no context before its question (the last "
                                f"{n_question}); give prompts longer than question_tokens")
        n = seq.shape[1]
        return [n - n_question, n]

    return plan


def _chunk_plan(chunk: int) -> Any:
    """The split of :func:`kv_policy`'s ``prefill_chunk``, for :func:`_splitting`: a forward of more than
    ``chunk`` new tokens runs as forwards of ``chunk`` tokens (the last one shorter)."""

    def plan(named: dict[str, Any], seq: torch.Tensor, positional: bool) -> list[int] | None:
        n = seq.shape[1]
        return None if positional or n <= chunk else [*range(chunk, n, chunk), n]

    return plan


def _chunked_forward(forward: Any, ends: Sequence[int], kwargs: dict[str, Any], new_cache: Any, *,
                     what: str = "prefill_chunk") -> Any:
    """``forward(**kwargs)`` fed as forwards ending at the new tokens ``ends`` (the last: all of them) into one
    cache (``new_cache(attention_mask)`` when the forward starts none: a cache laid out for every row's padding):
    the logits (and hidden states) of every chunk concatenated, the cache after the last. ``what`` names the
    option in errors."""
    ids = kwargs.get("input_ids")
    seq = ids if ids is not None else kwargs["inputs_embeds"]
    n = seq.shape[1]
    for name in ("output_attentions", "labels"):
        if kwargs.get(name):
            raise KvPolicyError(f"{what}: a forward with `{name}` cannot be chunked")
    for name, value in kwargs.items():  # e.g. an image's pixels, which belong to one chunk
        if name not in _CHUNKED and isinstance(value, torch.Tensor):
            raise KvPolicyError(f"{what}: a forward with the tensor argument `{name}` cannot be chunked")
    keep = kwargs.pop("logits_to_keep", 0)
    if not isinstance(keep, int):
        raise KvPolicyError(f"{what}: `logits_to_keep` must be a number of positions")
    cache_key = "cache" if "cache" in kwargs or "past_key_values" not in kwargs else "past_key_values"
    cache = kwargs.pop(cache_key, None)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise KvPolicyError(f"{what}: a forward needs a 2-D attention mask, not one of {mask.dim()} dims")
    before = 0 if mask is None else mask.shape[1] - n  # tokens the mask covers ahead of this forward's
    if cache is None:
        cache = new_cache(mask if mask is not None else torch.ones(seq.shape[:2], dtype=torch.long,
                                                                   device=seq.device))
        if isinstance(cache, HeadwiseCache):  # the forward is the prompt: headkv compresses after its last chunk
            cache.set_prompt_length(n)
    logits, hidden, out = [], None, None
    for a, b in zip([0, *ends[:-1]], ends, strict=True):
        part = dict(kwargs)
        for name in ("input_ids", "inputs_embeds", "position_ids", "cache_position"):
            value = kwargs.get(name)
            if value is not None:
                part[name] = value[:, a:b] if name in ("input_ids", "inputs_embeds") else value[..., a:b]
        if mask is not None:
            part["attention_mask"] = mask[:, : before + b]
        part[cache_key] = cache
        part["use_cache"] = True
        if keep:
            part["logits_to_keep"] = min(keep, b - a)
        out = forward(**part)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        logits.append(out.logits)
        states = getattr(out, "hidden_states", None)
        if states is not None:
            hidden = [[h] for h in states] if hidden is None else [h + [x] for h, x in zip(hidden, states, strict=True)]
    out.logits = torch.cat(logits, dim=1)
    if keep:
        out.logits = out.logits[:, -keep:]
    if hidden is not None:
        out.hidden_states = tuple(torch.cat(h, dim=1) for h in hidden)
    return out


def cuda_devices(model: torch.nn.Module) -> list[torch.device]:
    """The CUDA devices ``model`` computes on: where its parameters are, and the GPUs its ``device_map`` places
    modules on (an offloaded module's parameters are on ``meta`` between forwards), in index order."""
    found = {p.device for p in model.parameters() if p.device.type == "cuda"}
    for place in (getattr(model, "hf_device_map", None) or {}).values():
        if isinstance(place, int) and not isinstance(place, bool):
            found.add(torch.device("cuda", place))
        elif str(place).startswith("cuda"):
            found.add(torch.device(str(place)))
    indexed = {d if d.index is not None else torch.device("cuda", torch.cuda.current_device()) for d in found}
    return sorted(indexed, key=lambda d: d.index)


@contextlib.contextmanager
def kv_policy(model: torch.nn.Module, head_map: HeadMap, *, prefill_chunk: int | None = None,
              question_tokens: int = 0, cpu_peak: bool = False) -> Any:
    """Run every forward of ``model`` (a transformers causal LM) inside the block with a cache laid out by
    ``head_map``; yields the :class:`KvUsage` (complete once the block exits).

    A forward that starts without a cache (a prefill) gets a :class:`HeadwiseCache` for its left-padded
    attention mask, and ``use_cache`` on; a later forward that continues one keeps it. Under a map with
    every head full the model's own cache is used (the same logits as without the context) and only
    measured. With compressed heads the model must run with headlab's attention (``attn_implementation=
    "headlab"``), which reads each group over its own keys; a forward whose attention left the compressed
    heads unread, or that continues a cache of another type, is a :class:`KvPolicyError`.

    ``prefill_chunk``: a forward of more than this many new tokens runs as forwards of at most that many
    tokens into one cache (the same logits, concatenated, up to float rounding), so that the transient memory
    of a long prompt is bounded by the chunk (under ``razor``, each chunk's queries take their compensation
    tokens from the cache's sums and ring plus the chunk's own prefix). Under ``headkv`` every chunk of a
    prompt attends every head over all earlier prompt keys, which the cache holds until the prompt's last
    chunk, where the selection runs over the prompt's last ``observation_window`` queries (kept across
    chunks): the same kept keys as one forward; there the chunk bounds the activations, not the prompt's
    keys. Refused under ``prefill="full"`` maps with compressed heads.

    ``question_tokens`` (under a ``prefill="full"`` map with compressed heads; 0: off): a forward that starts
    without a cache runs as two forwards into one cache, every row's tokens but its last ``question_tokens``
    (the context: every head attends it in full, then the compressed heads keep their sinks and window), then
    those last tokens (the question), whose compressed heads attend only the kept sinks and window and the
    question's own earlier tokens, as decode steps do: kvpress's context/question split. The rows must be
    left-padded, each with more than ``question_tokens`` tokens. Under a map with every head full nothing is
    split (the question would attend the same keys).

    The peak memory (:attr:`KvUsage.peak_memory`) is measured on CUDA, and on a CPU with ``cpu_peak``
    (every operator inside the block is then tracked, which slows small models down)."""
    _check_chunkable(head_map, prefill_chunk)
    _check_question(head_map, question_tokens)
    compressed = not head_map.is_full
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if compressed and impl != "headlab":
        raise KvPolicyError(f"a KV policy with compressed heads needs headlab's attention; this model runs "
                            f"attn_implementation={impl!r}")
    n_layers = head_map.n_layers
    usage = KvUsage(head_map, np.zeros(n_layers, dtype=np.int64), np.zeros(n_layers, dtype=np.int64))
    target = _decoder(model)
    gpus = cuda_devices(model)
    cuda = gpus[0] if gpus else None
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)

    def before(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        kwargs = dict(kwargs)
        kwargs["use_cache"] = True
        if cache is None:
            if compressed:
                mask = kwargs.get("attention_mask")
                if mask is None:
                    ids = kwargs.get("input_ids", args[0] if args else None)
                    if ids is None:
                        ids = kwargs["inputs_embeds"][..., 0]
                    mask = torch.ones(ids.shape[:2], dtype=torch.long, device=ids.device)
                elif mask.dim() != 2:
                    raise KvPolicyError(f"a KV policy needs a 2-D attention mask, not one of {mask.dim()} dims")
                kwargs.pop("past_key_values", None)
                kwargs["cache"] = HeadwiseCache.from_attention_mask(head_map, mask)
        elif compressed and not isinstance(cache, HeadwiseCache):
            raise KvPolicyError(f"a KV policy with compressed heads cannot continue a {type(cache).__name__}")
        running = kwargs.get("cache")
        running = kwargs.get("past_key_values") if running is None else running
        set_running_cache(running if isinstance(running, HeadwiseCache) else None)
        for layer in getattr(running_cache(), "layers", ()):
            layer.implicit_mask = False
        return args, kwargs

    def after(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        set_running_cache(None)
        cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        if isinstance(cache, HeadwiseCache):
            unread = [i for i, layer in enumerate(cache.layers) if layer.pending is not None]
            if unread:
                raise KvPolicyError(f"layer {unread[0]}: the attention did not read the compressed KV heads (the "
                                    "model must run with headlab's attention)")
        if cache is not None:
            usage._track(cache)

    handles = [target.register_forward_pre_hook(before, with_kwargs=True),
               target.register_forward_hook(after, with_kwargs=True)]
    if prefill_chunk is not None:
        handles.append(_splitting(model, _chunk_plan(prefill_chunk), lambda mask: HeadwiseCache.from_attention_mask(
            head_map, mask) if compressed else None, "prefill_chunk"))
    if question_tokens and compressed:
        def question_cache(mask: torch.Tensor) -> HeadwiseCache:
            cache = HeadwiseCache.from_attention_mask(head_map, mask)
            for layer in cache.layers:
                layer.question_tokens = question_tokens
            return cache

        handles.append(_splitting(model, _question_plan(question_tokens), question_cache, "question_tokens"))
    tracker = LiveBytes() if cuda is None and cpu_peak else None
    try:
        with tracker if tracker is not None else contextlib.nullcontext():
            yield usage
    finally:
        set_running_cache(None)
        for handle in handles:
            handle.remove()
        usage._fold()
        if cuda is not None:
            usage.peak_memory = sum(int(torch.cuda.max_memory_allocated(gpu)) for gpu in gpus)
            usage.peak_memory_measure = _CUDA_PEAK if len(gpus) == 1 else \
                f"{_CUDA_PEAK}, summed over {', '.join(str(gpu) for gpu in gpus)}"
        elif tracker is not None:
            usage.peak_memory = int(tracker.peak)
            usage.peak_memory_measure = _CPU_PEAK


class _ChunkHandle:
    """Undoes :func:`_splitting`."""

    def __init__(self, model: torch.nn.Module, previous: Any) -> None:
        self.model, self.previous = model, previous

    def remove(self) -> None:
        if self.previous is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self.previous


def _splitting(model: torch.nn.Module, plan: Any, new_cache: Any, what: str) -> _ChunkHandle:
    """``model``'s forward, until the handle is removed, runs a forward that ``plan(named arguments, input ids or
    embeddings, positional arguments after them?)`` splits (the ends of the forwards, in new tokens; None: not
    split) as those forwards into one cache (:func:`_chunked_forward`; ``what`` names the option in errors)."""
    previous = model.__dict__.get("forward")
    plain = model.forward

    @functools.wraps(plain)
    def forward(*args: Any, **kwargs: Any) -> Any:
        named = {"input_ids": args[0], **kwargs} if args else kwargs
        seq = named.get("input_ids")
        seq = seq if seq is not None else named.get("inputs_embeds")
        ends = None if seq is None else plan(named, seq, len(args) > 1)
        if ends is None:
            return plain(*args, **kwargs)
        return _chunked_forward(plain, ends, named, new_cache, what=what)

    model.forward = forward
    return _ChunkHandle(model, previous)
