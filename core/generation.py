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


@dataclass
class Decoded:
    """Generated token ids (without prompt) and their text, per row."""

    tokens: list[list[int]]
    texts: list[str]


def instrumented(lm: LoadedModel, plan: Any) -> contextlib.AbstractContextManager[Any]:
    """The instrumentation context for ``plan`` (a no-op when there is no plan)."""
    if plan is None:
        return contextlib.nullcontext()
    from .instrument import instrument

    return instrument(lm.model, plan)


def decode_loop(request: DecodeRequest, choose: Callable[[Any, torch.Tensor], torch.Tensor], *,
                forward_kwargs: dict[str, Any] | None = None) -> Decoded:
    """Run the KV-cache loop: prefill, then one token per step chosen by ``choose(outputs, generated)``.

    ``choose`` receives the model outputs of the step (logits of the last position at
    ``outputs.logits[:, -1]``) and the tokens generated so far ``(batch, t)``; it returns ``(batch,)``
    token ids. Rows stop at EOS or a stop string; the loop stops when every row has.
    """
    lm, batch = request.lm, request.batch
    model, tok = lm.model, lm.tokenizer
    eos = _eos_ids(lm)
    kwargs = dict(forward_kwargs or {})
    mask = batch.attention_mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    generated = torch.empty((batch.size, 0), dtype=torch.long, device=mask.device)
    finished = torch.zeros(batch.size, dtype=torch.bool, device=mask.device)
    texts = [""] * batch.size
    with torch.no_grad(), instrumented(lm, request.plan):
        out = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=pos, use_cache=True, **kwargs)
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
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                        cache=out.cache, use_cache=True, **kwargs)
    tokens = [_trim(row.tolist(), eos.tolist()) for row in generated]
    texts = [_cut_stop(tok.decode(t, skip_special_tokens=True), request.stop) if tok is not None else
             " ".join(map(str, t)) for t in tokens]
    return Decoded(tokens, texts)


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
