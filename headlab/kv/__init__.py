"""Head-level KV-cache policies: head maps, and a cache that holds fewer keys for compressed heads.

A *head map* (:class:`HeadMap`) says, per ``(layer, kv_head)``, whether a key/value head keeps its whole cache
(``kv_full``) or a bounded one: the ``sink`` first tokens of its row plus the ``window`` most recent tokens
(DuoAttention's streaming heads; StreamingLLM's layout when no head is full). Decisions are per KV head: under
grouped-query attention, KV head ``j`` serves query heads ``j * g .. (j + 1) * g - 1`` (``g = n_heads //
n_kv_heads``, transformers' ``repeat_kv`` layout), and a query-head selection becomes a KV-head one by a
:data:`GqaRule`. Budgets (``top``, a count of full heads) are counted in KV heads.

:func:`kv_heads` compiles any spec head selection (``{from: step, top: k}``, a threshold, pairs, layers, a
retrieval-head or PASTA JSON file, or DuoAttention's ``full_attention_heads.tsv``) into the boolean
``kv_full`` array; :func:`random_kv_heads` draws the same number of full KV heads at random (the control).
The ``kv`` component category (:func:`headlab.hookspecs.headlab_register_kv_policies`) turns a policy
config into a :class:`HeadMap`.

Budgets (:class:`KvBudget`: a kept fraction, a byte size or a mean of tokens per KV head) make as many KV
heads full as fit at a context length, in the order :func:`kv_priority` gives (:meth:`HeadMap.budgeted`).
HeadKV's per-KV-head budgets are a :class:`HeadBudgetMap` (:func:`headkv_allocation`), and
:func:`snapkv_keep` picks the keys each KV head keeps after a prefill. :func:`to_kvpress` exports a map as
a press of kvpress (an optional dependency).

:class:`HeadwiseCache` is a transformers :class:`~transformers.Cache` that stores, per layer, a *full group*
(the full KV heads, every position) and a *bounded group* (the compressed KV heads: ``sink`` slots plus a
ring buffer of ``window`` slots), batched with left padding: positions are counted in each row's own
tokens, so the sinks of a left-padded row are its first real tokens. Its ``nbytes`` are the bytes of the
keys and values it actually holds. Its ``update`` leaves a :class:`SplitCall` that headlab's attention
(:mod:`headlab.instrument.kv_split`) reads each group from; :func:`kv_policy` runs a model's forwards with
such caches and measures them (:class:`KvUsage`). Under a :class:`HeadBudgetMap` its layers are
:class:`HeadBudgetLayer`: the prefill (in one forward or, with ``prefill_chunk``, in several) attends every
head, then each compressed KV head keeps only the keys :func:`snapkv_keep` selects for it (its own buffers, no
padding to another head's budget) and every later token.

The modules, one concern each, in dependency order: ``errors`` (:class:`KvPolicyError`), ``split`` (the
split-call contract between a cache layer and the attention), ``maps`` (head maps, budgets, HeadKV's
allocation), ``snapkv`` (SnapKV's key selection), ``layers`` (the cache layers), ``cache``
(:class:`HeadwiseCache`), ``usage`` (bytes held and peak memory), ``driver`` (:func:`kv_policy`),
``selection`` (the spec-facing selection types and their readers), ``press`` (the kvpress export) and
``view`` (a run's metrics against its KV bytes, for ``headlab report`` and the widgets).

The names below load their module on first use, so that the engine modules (``split``, ``layers``), which
:mod:`headlab.instrument` imports, load without the spec-facing ones.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache import HeadwiseCache
    from .driver import kv_policy
    from .errors import KvPolicyError
    from .layers import HeadBudgetLayer, HeadwiseLayer
    from .maps import HeadBudgetMap, HeadMap, KvBudget, headkv_allocation, token_bytes
    from .press import to_kvpress
    from .selection import (
        DuoHeadsFile,
        GqaRule,
        HeadScoreSource,
        KvHeadSelection,
        ScoresFile,
        ScoresFrom,
        head_scores,
        kv_head_scores,
        kv_heads,
        kv_priority,
        random_kv_heads,
        read_duo_heads,
        read_head_scores,
    )
    from .snapkv import snapkv_keep
    from .split import SplitCall, split_call
    from .usage import KvUsage

#: each public name and the module of the package that defines it
_HOME = {
    "KvPolicyError": "errors",
    "SplitCall": "split", "split_call": "split",
    "HeadBudgetMap": "maps", "HeadMap": "maps", "KvBudget": "maps", "headkv_allocation": "maps",
    "token_bytes": "maps",
    "snapkv_keep": "snapkv",
    "HeadBudgetLayer": "layers", "HeadwiseLayer": "layers",
    "HeadwiseCache": "cache",
    "KvUsage": "usage",
    "kv_policy": "driver",
    "DuoHeadsFile": "selection", "GqaRule": "selection", "HeadScoreSource": "selection",
    "KvHeadSelection": "selection", "ScoresFile": "selection", "ScoresFrom": "selection", "head_scores": "selection",
    "kv_head_scores": "selection", "kv_heads": "selection", "kv_priority": "selection",
    "random_kv_heads": "selection", "read_duo_heads": "selection", "read_head_scores": "selection",
    "to_kvpress": "press",
}

__all__ = ["DuoHeadsFile", "GqaRule", "HeadBudgetLayer", "HeadMap", "HeadwiseCache", "HeadwiseLayer", "KvHeadSelection",
           "KvPolicyError", "KvUsage", "SplitCall", "kv_heads", "kv_policy", "random_kv_heads", "read_duo_heads",
           "split_call",
           "HeadBudgetMap", "HeadScoreSource", "KvBudget", "ScoresFile", "ScoresFrom", "head_scores",
           "headkv_allocation", "kv_head_scores", "kv_priority", "read_head_scores", "snapkv_keep", "to_kvpress",
           "token_bytes"]


def __getattr__(name: str) -> Any:
    """A public name of the package, from the module that defines it (imported on first use)."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
