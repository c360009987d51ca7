"""Batches of prompts and the KV-cache decoding loop decoding strategies build on.

Prompts are left-padded so every row's last prompt token sits at the same position; position ids
follow the attention mask, so padded rows decode exactly like unpadded ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .context import Example
from .model import LoadedModel


@dataclass
class Batch:
    """Left-padded token ids of a batch of prompts, with character offsets for span mapping."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    offsets: list[list[tuple[int, int]]]
    pad: list[int]
    examples: list[Example] = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def token_span(self, row: int, start: int, end: int) -> tuple[int, int]:
        """Token positions ``[s, e)`` (padded coordinates) covering characters ``[start, end)`` of a prompt."""
        toks = [i for i, (a, b) in enumerate(self.offsets[row]) if b > start and a < end and b > a]
        if not toks:
            raise ValueError(f"characters [{start}, {end}) of row {row} cover no token")
        return toks[0] + self.pad[row], toks[-1] + 1 + self.pad[row]

    def spans(self, name: str) -> list[list[tuple[int, int]]]:
        """Token spans of the examples' character spans called ``name``, per row."""
        return [[self.token_span(r, s, e) for s, e in ex.spans.get(name, [])] for r, ex in enumerate(self.examples)]


def tokenize(lm: LoadedModel, examples: list[Example], device: str | None = None) -> Batch:
    """Tokenize examples (their ``input_ids`` if set, else ``prompt``) into a left-padded batch."""
    tok = lm.tokenizer
    rows: list[list[int]] = []
    offsets: list[list[tuple[int, int]]] = []
    for ex in examples:
        if ex.input_ids is not None:
            rows.append(list(ex.input_ids))
            offsets.append([(0, 0)] * len(ex.input_ids))
            continue
        if tok is None:
            raise ValueError("this model has no tokenizer; use a task that gives token ids")
        enc = tok(ex.prompt, return_offsets_mapping=True, add_special_tokens=True)
        rows.append(list(enc["input_ids"]))
        offsets.append([tuple(o) for o in enc["offset_mapping"]])
    pad_id = _pad_id(tok)
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    pads = []
    for i, r in enumerate(rows):
        ids[i, n - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, n - len(r):] = 1
        pads.append(n - len(r))
    device = device or lm.device
    return Batch(ids.to(device), mask.to(device), offsets, pads, list(examples))


def _pad_id(tok: Any) -> int:
    if tok is None:
        return 0
    for attr in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tok, attr, None)
        if value is not None:
            return int(value)
    return 0


@dataclass
class DecodeRequest:
    """Everything a decoding strategy needs for one batch."""

    lm: LoadedModel
    batch: Batch
    max_new_tokens: int
    stop: list[str] = field(default_factory=list)
    plan: Any = None
    seed: int = 0
    ctx: Any = None

    def heads(self, selection: Any) -> list[tuple[int, int]]:
        """Resolve a spec head selection (``{from: step, top: k}``, a list, a file, PASTA format).

        Inside a run this is ``ctx.heads`` of the step (``ctx``: the :class:`~headlab.context.StepContext`,
        so ``from:`` sees earlier steps); without a step context only explicit lists and files resolve.
        """
        if self.ctx is not None:
            return self.ctx.heads(selection)
        from .heads import select_heads

        return select_heads(selection, {}, self.lm.geometry)


@dataclass
class Decoded:
    """Generated token ids (without prompt) and their text, per row.

    ``info`` holds optional diagnostics of a strategy, which the ``generate`` action stores with the
    outputs (:func:`headlab.runner.decode_info`):

    - a list over decode steps of per-row values (``info["alpha"][t][r]``: DeCoRe's alpha, DoLa's
      ``premature_layer``) becomes an ``(example, step)`` array of the same name, empty (NaN, or -1 for
      integers) after a row's last token;
    - ``heads``, the ``(layer, head)`` pairs a strategy edited (DeCoRe's masked heads), becomes the
      boolean ``(layer, head)`` array ``decode_heads``;
    - anything else JSON-serialisable becomes the attribute ``decode_<key>`` (DoLa's
      ``candidate_layers``).
    """

    tokens: list[list[int]]
    texts: list[str]
    info: dict[str, Any] = field(default_factory=dict)


def instrumented(lm: LoadedModel, plan: Any) -> contextlib.AbstractContextManager[Any]:
    """The instrumentation context for ``plan`` (a no-op when there is no plan)."""
    if plan is None:
        return contextlib.nullcontext()
    from .instrument import instrument

    return instrument(lm.model, plan)


def decode_loop(request: DecodeRequest, choose: Callable[[Any, torch.Tensor], torch.Tensor], *,
                forward_kwargs: dict[str, Any] | None = None,
                rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                forward: Callable[..., Any] | None = None,
                split_prompt: Callable[[], None] | None = None,
                shared_until: int | None = None) -> Decoded:
    """Run the KV-cache loop: prefill, then one token per step chosen by ``choose(outputs, generated)``.

    ``choose`` receives the model outputs of the step (logits of the last position at
    ``outputs.logits[:, -1]``) and the tokens generated so far ``(batch, t)``; it returns ``(batch,)``
    token ids. Rows stop at EOS or a stop string; the loop stops when every row has.

    Options for strategies that contrast several forwards of one prompt in one batched forward:

    - ``rows``: ``(input_ids, attention_mask)`` of the forward batch when it is not the request's batch:
      ``k * B`` left-padded rows for ``B`` prompts; forward row ``i`` continues prompt ``i % B`` (the token
      chosen for prompt ``r`` is fed to rows ``r, r + B, ...``). ``outputs`` then has ``k * B`` rows and
      ``choose`` still returns ``B`` tokens.
    - ``forward``: called instead of the model with the same keyword arguments (``input_ids``,
      ``attention_mask``, ``position_ids``, ``use_cache``, ``cache`` after the prefill, and
      ``forward_kwargs``); it returns an object with ``.logits`` and ``.cache`` (e.g. an expert and an
      amateur model run together).
    - ``split_prompt``: prefill the prompt without its last token, call ``split_prompt()`` (e.g. to add
      edits to the plan), then run the last prompt token as its own step (DeCoRe's reference prefix).
    - ``shared_until``: with ``rows`` made of ``k`` identical copies of the batch whose plan edits differ
      only from this layer on (DeCoRe), the layers below it run once on one copy
      (:func:`~headlab.instrument.shared_trunk`); with ``split_prompt`` the prefix is prefilled once and
      its cache repeated. Outputs are those of the ``k * B`` rows, as without it.
    """
    lm, batch = request.lm, request.batch
    model, tok = lm.model, lm.tokenizer
    run = forward or model
    eos = _eos_ids(lm)
    kwargs = dict(forward_kwargs or {})
    input_ids, mask = rows if rows is not None else (batch.input_ids, batch.attention_mask)
    if input_ids.shape[0] % batch.size:
        raise ValueError(f"rows: {input_ids.shape[0]} forward rows is not a multiple of {batch.size} prompts")
    copies = input_ids.shape[0] // batch.size
    trunk = shared_until if shared_until is not None and copies > 1 else None
    if trunk is not None:
        if forward is not None:
            raise ValueError("decode_loop: shared_until runs the model itself; it cannot take a forward function")
        B = batch.size
        if not (torch.equal(input_ids, input_ids[:B].repeat(copies, 1)) and torch.equal(mask, mask[:B].repeat(copies, 1))):
            raise ValueError("decode_loop: shared_until needs rows that are identical copies of the batch")
        input_ids, mask = input_ids[:B], mask[:B]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    generated = torch.empty((batch.size, 0), dtype=torch.long, device=mask.device)
    finished = torch.zeros(batch.size, dtype=torch.bool, device=mask.device)
    texts = [""] * batch.size

    def trunk_at(layer: int | None) -> contextlib.AbstractContextManager[Any]:
        from .instrument import shared_trunk

        return contextlib.nullcontext() if layer is None else shared_trunk(model, layer, copies)

    with torch.no_grad(), instrumented(lm, request.plan):
        cache = None
        if split_prompt is not None and input_ids.shape[1] > 1:
            with trunk_at(None if trunk is None else lm.geometry.n_layers):
                cache = run(input_ids=input_ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1],
                            use_cache=True, **kwargs).cache
            if trunk is not None:
                from .instrument import expand_cache

                expand_cache(cache, trunk, copies)
            split_prompt()
        with trunk_at(trunk):
            if cache is not None:
                out = run(input_ids=input_ids[:, -1:], attention_mask=mask, position_ids=pos[:, -1:],
                          cache=cache, use_cache=True, **kwargs)
            else:
                out = run(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, **kwargs)
            for _ in range(request.max_new_tokens):
                nxt = choose(out, generated).to(generated.device)
                nxt = torch.where(finished, torch.full_like(nxt, _pad_id(tok)), nxt)
                generated = torch.cat([generated, nxt[:, None]], dim=1)
                finished |= torch.isin(nxt, eos) if eos.numel() else torch.zeros_like(finished)
                if request.stop and tok is not None:
                    for r in range(batch.size):
                        if not finished[r]:
                            texts[r] = tok.decode(generated[r], skip_special_tokens=True)
                            finished[r] = any(s in texts[r] for s in request.stop)
                if bool(finished.all()):
                    break
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                pos = pos[:, -1:] + 1
                feed = nxt.repeat(copies) if copies > 1 and trunk is None else nxt
                out = run(input_ids=feed[:, None], attention_mask=mask, position_ids=pos,
                          cache=out.cache, use_cache=True, **kwargs)
    tokens = [_trim(row.tolist(), eos.tolist()) for row in generated]
    texts = [_cut_stop(tok.decode(t, skip_special_tokens=True), request.stop) if tok is not None else
             " ".join(map(str, t)) for t in tokens]
    return Decoded(tokens, texts)


def prefill(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            *, per_row: bool | None = None) -> Any:
    """The KV cache of a left-padded batch of prompts, computing no logits beyond the last position.

    ``per_row`` (default: on a CPU) runs each row on its own tokens, without its padding, and stacks the
    caches left-padded with zeros (keys the attention mask hides): a single unpadded row takes SDPA's
    causal kernel, where a padded batch needs a masked one that is slower on a CPU. Same cache as the
    batched prefill up to float rounding. Models whose cache has layers other than plain growing ones
    (sliding windows, static or quantised caches) are prefilled batched.
    """
    from transformers.cache_utils import DynamicLayer

    def run(**kw: Any) -> Any:
        try:
            return model(**kw, use_cache=True, logits_to_keep=1)
        except TypeError:  # a model without logits_to_keep
            return model(**kw, use_cache=True)

    B, n = input_ids.shape
    if per_row is None:
        per_row = input_ids.device.type == "cpu" and B > 1
    pads = (attention_mask == 0).sum(-1).tolist()
    if per_row and all(bool(attention_mask[r, p:].all()) and p < n for r, p in enumerate(pads)):
        caches = [run(input_ids=input_ids[r: r + 1, p:], attention_mask=attention_mask[r: r + 1, p:],
                      position_ids=position_ids[r: r + 1, p:]).cache for r, p in enumerate(pads)]
        if all(type(layer) is DynamicLayer for c in caches for layer in c.layers):
            cache = caches[0]
            for i, layer in enumerate(cache.layers):
                for name in ("keys", "values"):
                    parts = [getattr(c.layers[i], name) for c in caches]
                    setattr(layer, name, torch.cat([torch.nn.functional.pad(t, (0, 0, n - t.shape[2], 0))
                                                    for t in parts]))
            return cache
    return run(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).cache


def _eos_ids(lm: LoadedModel) -> torch.Tensor:
    ids: list[int] = []
    gen = getattr(lm.model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(lm.tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.append(src)
        elif isinstance(src, list):
            ids.extend(src)
    return torch.tensor(sorted(set(ids)), dtype=torch.long, device=lm.device)


def _trim(tokens: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def _cut_stop(text: str, stop: list[str]) -> str:
    cut = min((text.index(s) for s in stop if s in text), default=len(text))
    return text[:cut]


# --------------------------------------------------------------------------- scoring
@dataclass
class ScoreRequest:
    """Rows to score under a decoding strategy: each row is a prompt followed by a continuation.

    ``batch`` holds the full texts ``prompt + continuation`` (left-padded; ``batch.examples[r]`` keeps the
    source example's spans and meta, so steering applies as in ``generate``); the last ``n_tokens[r]``
    tokens of row ``r`` are the continuation. ``sources[r]`` is the original example and
    ``continuations[r]`` the continuation text (CAD rebuilds the row without the context from them).
    """

    lm: LoadedModel
    batch: Batch
    n_tokens: list[int]
    sources: list[Example]
    continuations: list[str]
    plan: Any = None
    seed: int = 0
    ctx: Any = None

    heads = DecodeRequest.heads

    @property
    def width(self) -> int:
        """``C``: the longest continuation in tokens (the scored positions are the last ``C``)."""
        return max(self.n_tokens)

    def targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(targets, valid)``, both (rows, C): the continuation tokens (the last C positions of each row)
        and which of them belong to the row's continuation (shorter continuations are right-aligned)."""
        C = self.width
        ids = self.batch.input_ids[:, -C:]
        n = torch.tensor(self.n_tokens, device=ids.device)
        valid = torch.arange(C, device=ids.device)[None, :] >= (C - n)[:, None]
        return ids, valid


@dataclass
class Scored:
    """Per row: the summed score of the continuation tokens, and the per-token scores."""

    logprobs: list[float]
    tokens: list[list[float]] = field(default_factory=list)


def continuation_batch(lm: LoadedModel, pairs: list[tuple[Example, str]], device: str | None = None,
                       ) -> tuple[Batch, list[int]]:
    """Tokenize ``prompt + continuation`` rows; the continuation is what follows the prompt's own tokens.

    As in the DoLa and DeCoRe reference code, the continuation tokens of a row are the tokens of the full
    text after the first ``len(tokenize(prompt))`` ones.
    """
    tok = lm.tokenizer
    if tok is None:
        raise ValueError("scoring needs a tokenizer (the model has none)")
    rows = [Example(prompt=ex.prompt + cont, spans=ex.spans, meta=ex.meta) for ex, cont in pairs]
    n_tokens = []
    for (ex, _), row in zip(pairs, rows, strict=True):
        full = len(tok(row.prompt, add_special_tokens=True)["input_ids"])
        prefix = len(tok(ex.prompt, add_special_tokens=True)["input_ids"])
        if full - prefix < 1:
            raise ValueError(f"continuation adds no token to the prompt {ex.prompt[-40:]!r}")
        n_tokens.append(full - prefix)
    return tokenize(lm, rows, device), n_tokens


def sum_continuation(scores: torch.Tensor, request: ScoreRequest) -> Scored:
    """Gather ``scores`` (rows, C, V), the strategy's per-token scores at the C positions that predict the
    continuation (``logits[:, -C-1:-1]``), at the continuation tokens, and sum each row's own tokens."""
    ids, valid = request.targets()
    picked = scores.float().gather(-1, ids[..., None])[..., 0]
    per_token = [picked[r][valid[r]].tolist() for r in range(picked.shape[0])]
    return Scored([float(sum(t)) for t in per_token], per_token)
