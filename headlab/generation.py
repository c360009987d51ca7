"""Batches of prompts, and headlab's one KV-cache decoding loop (:func:`decode_loop` over a
:class:`DecodeState`) that every decoding strategy and every detector that decodes runs.

Prompts are left-padded so every row's last prompt token sits at the same position; position ids
follow the attention mask, so padded rows decode exactly like unpadded ones. Multiple-choice scoring
(:class:`ScoreRequest`, :class:`Scored`) lives here too.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xarray as xr
from transformers.cache_utils import DynamicLayer

from .context import Example
from .heads import select_heads
from .instrument import expand_cache, instrument, shared_trunk
from .model import LoadedModel
from .vision import encode, tile_inputs

__all__ = ["Batch", "Choose", "ContextLengthWarning", "DecodeRequest", "DecodeState", "Decoded", "ModelCall", "PromptSplit", "Rows",
           "ScoreRequest", "Scored", "continuation_batch", "decode_info", "decode_loop", "instrumented", "prefill",
           "sum_continuation", "tokenize"]


@dataclass
class Batch:
    """Left-padded token ids of a batch of prompts, with character offsets for span mapping.

    ``continuation[r]`` is the number of tokens at the end of row ``r`` that are not prompt: the scored
    continuation of a :func:`continuation_batch` row (a choice of a multiple-choice example). Empty (the
    default, a batch of prompts to generate from) means every row is all prompt. Steering methods that
    treat prompt keys specially (PASTA) read a row's prompt from :meth:`prompt_span`, so a choice's own
    tokens are treated like generated tokens, as in ``generate``.

    A batch of examples with images (a vision-language model) also has ``model_inputs``, the processor's
    inputs for the forward over the prompts (``pixel_values``, ...; pass them with :meth:`forward_inputs`),
    ``image_spans`` (per row, per image: its tokens' padded positions ``[start, end)``; also
    ``spans("image")``), ``image_grids`` (per row, per image: the rows and columns of its tokens, row-major)
    and, for models with multimodal rotary positions (Qwen2-VL), ``position_ids`` of shape
    ``(3, batch, length)``; otherwise positions follow the attention mask (:meth:`positions`).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    offsets: list[list[tuple[int, int]]]
    pad: list[int]
    examples: list[Example] = field(default_factory=list)
    continuation: list[int] = field(default_factory=list)
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    image_spans: list[list[tuple[int, int]]] = field(default_factory=list)
    image_grids: list[list[tuple[int, int]]] = field(default_factory=list)
    position_ids: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def prompt_end(self, row: int) -> int:
        """The padded position where row ``row``'s prompt ends: its keys ``>=`` this are its continuation
        (``continuation[row]`` tokens; none in a batch of prompts, whose prompts end at :attr:`length`)."""
        return self.length - (int(self.continuation[row]) if self.continuation else 0)

    def prompt_span(self, row: int) -> tuple[int, int]:
        """``[start, end)``: the padded positions of row ``row``'s prompt (``pad[row]``, :meth:`prompt_end`)."""
        return self.pad[row], self.prompt_end(row)

    def token_span(self, row: int, start: int, end: int) -> tuple[int, int]:
        """Token positions ``[s, e)`` (padded coordinates) covering characters ``[start, end)`` of a prompt."""
        toks = [i for i, (a, b) in enumerate(self.offsets[row]) if b > start and a < end and b > a]
        if not toks:
            raise ValueError(f"characters [{start}, {end}) of row {row} cover no token")
        return toks[0] + self.pad[row], toks[-1] + 1 + self.pad[row]

    def spans(self, name: str) -> list[list[tuple[int, int]]]:
        """Token spans of the examples' character spans called ``name``, per row; ``image``: the image tokens
        (:attr:`image_spans`) when the batch has images and no example names a span ``image``."""
        if name == "image" and self.image_spans and not any("image" in ex.spans for ex in self.examples):
            return [list(row) for row in self.image_spans]
        return [[self.token_span(r, s, e) for s, e in ex.spans.get(name, [])] for r, ex in enumerate(self.examples)]

    @property
    def has_images(self) -> bool:
        """Whether the batch's forward takes processor inputs (its examples have images)."""
        return bool(self.model_inputs)

    def positions(self, copies: int = 1) -> torch.Tensor:
        """Position ids of the prompts for ``copies`` copy-major copies of the batch: :attr:`position_ids`
        if set, else the attention mask's running count (padding at 0)."""
        if self.position_ids is None:
            mask = self.attention_mask.repeat(copies, 1) if copies > 1 else self.attention_mask
            return (mask.cumsum(-1) - 1).clamp(min=0)
        return self.position_ids.repeat(1, copies, 1) if copies > 1 else self.position_ids

    def forward_inputs(self, copies: int = 1) -> dict[str, torch.Tensor]:
        """The processor inputs (:attr:`model_inputs`) for ``copies`` copy-major copies of the batch."""

        return tile_inputs(self.model_inputs, copies)


class ContextLengthWarning(UserWarning):
    """A prompt longer than the model's context window was tokenized (:func:`tokenize`)."""


def _warn_long(lm: LoadedModel, rows: list[list[int]], examples: list[Example]) -> None:
    limit = lm.context_length
    long = [i for i, r in enumerate(rows) if limit is not None and len(r) > limit]
    if not long:
        return
    i = long[0]
    more = f" (and {len(long) - 1} more in this batch)" if len(long) > 1 else ""
    start = examples[i].prompt[:40] if i < len(examples) and examples[i].prompt else ""
    which = f"example {i} of the batch" + (f" ({start!r}...)" if start else "")
    warnings.warn(f"{which} is {len(rows[i]):,} tokens{more}, longer than the model's context window of {limit:,} "
                  "tokens: outputs past it are unreliable; shorten the prompt (in a spec, the task), or set "
                  "`model: {extrapolate: true}` to run past it on purpose", ContextLengthWarning, stacklevel=3)


def tokenize(lm: LoadedModel, examples: list[Example], device: str | None = None) -> Batch:
    """Tokenize examples (their ``input_ids`` if set, else ``prompt``, with their ``images`` through the
    model's processor) into a left-padded batch. A prompt longer than the model's context window gets one
    :class:`ContextLengthWarning` per batch (in place of the tokenizer's own warning), naming the example."""
    tok = lm.tokenizer
    rows: list[list[int]] = []
    offsets: list[list[tuple[int, int]]] = []
    encoded: list[Any] = []
    for ex in examples:
        if ex.images:

            enc_images = encode(lm, ex)
            rows.append(enc_images.ids)
            offsets.append(enc_images.offsets)
            encoded.append(enc_images)
            continue
        encoded.append(None)
        if ex.input_ids is not None:
            rows.append(list(ex.input_ids))
            offsets.append([(0, 0)] * len(ex.input_ids))
            continue
        if tok is None:
            raise ValueError("this model has no tokenizer; use a task that gives token ids")
        enc = tok(ex.prompt, return_offsets_mapping=True, add_special_tokens=True)
        rows.append(list(enc["input_ids"]))
        offsets.append([tuple(o) for o in enc["offset_mapping"]])
    _warn_long(lm, rows, examples)
    pad_id = lm.pad_id
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    pads = []
    for i, r in enumerate(rows):
        ids[i, n - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, n - len(r):] = 1
        pads.append(n - len(r))
    device = device or lm.device
    batch = Batch(ids.to(device), mask.to(device), offsets, pads, list(examples))
    if any(e is not None for e in encoded):
        _add_images(lm, batch, encoded, device)
    return batch


def _add_images(lm: LoadedModel, batch: Batch, encoded: list[Any], device: str) -> None:
    """Processor inputs, image spans and grids of a batch whose examples have images."""
    if any(e is None for e in encoded):
        raise ValueError("a batch mixes examples with and without images; give every example of a task images, "
                         "or none")
    n = batch.length
    inputs: dict[str, list[torch.Tensor]] = {}
    for e, pad in zip(encoded, batch.pad, strict=True):
        for k, v in e.per_token.items():
            inputs.setdefault(k, []).append(torch.nn.functional.pad(v, (n - v.shape[1], 0)))
        for k, v in e.inputs.items():
            inputs.setdefault(k, []).append(v)
        batch.image_spans.append([(s + pad, t + pad) for s, t in e.spans])
        batch.image_grids.append(list(e.grids))
    batch.model_inputs = {k: torch.cat(v).to(device) for k, v in inputs.items()}
    rope_index = getattr(getattr(lm.model, "model", None), "get_rope_index", None)
    if rope_index is not None and "mm_token_type_ids" in batch.model_inputs:
        kw = {k: v for k, v in batch.model_inputs.items() if k in ("image_grid_thw", "video_grid_thw")}
        batch.position_ids, _ = rope_index(batch.input_ids, mm_token_type_ids=batch.model_inputs["mm_token_type_ids"],
                                           attention_mask=batch.attention_mask, **kw)


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

        return select_heads(selection, {}, self.lm.geometry)


@dataclass
class Decoded:
    """Generated token ids (without prompt) and their text, per row.

    ``info`` holds optional diagnostics of a strategy, which the ``generate`` action stores with the
    outputs (:func:`decode_info`):

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


def decode_info(parts: list[tuple[dict[str, Any], list[int]]], geometry: Any,
                ) -> tuple[dict[str, xr.DataArray], dict[str, Any]]:
    """The arrays and attributes a ``generate`` step stores from its batches' ``Decoded.info``.

    It is the storage convention of the :attr:`Decoded.info` contract, so any action that decodes (the
    built-in ``generate``, or a third party's) stores a strategy's diagnostics the same way.

    ``parts``: per batch, ``(info, generated length per row)``. Per-step values (a list over steps of
    per-row values) become ``(example, step)`` arrays, kept up to each row's last token (the step that
    chose EOS included); ``heads`` becomes the boolean ``(layer, head)`` array ``decode_heads``; other
    values equal in every batch become attributes ``decode_<key>``.
    """
    arrays: dict[str, xr.DataArray] = {}
    attrs: dict[str, Any] = {}
    if not parts:
        return arrays, attrs
    keys = [k for k in parts[0][0] if all(k in info for info, _ in parts)]
    for key in keys:
        values = [info[key] for info, _ in parts]
        if key == "heads":
            mask = np.zeros((geometry.n_layers, geometry.n_heads), dtype=bool)
            for layer, head in {(int(a), int(b)) for v in values for a, b in v}:
                mask[layer, head] = True
            arrays["decode_heads"] = xr.DataArray(mask, dims=("layer", "head"), coords={
                "layer": np.arange(geometry.n_layers), "head": np.arange(geometry.n_heads)})
        elif all(_per_step(v, len(n)) for v, (_, n) in zip(values, parts, strict=True)):
            rows = [[step[r] for step in v] for v, (_, n) in zip(values, parts, strict=True) for r in range(len(n))]
            lengths = [k for _, n in parts for k in n]
            width = max((len(r) for r in rows), default=0)
            ints = all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for r in rows for x in r)
            arr = np.full((len(rows), width), -1 if ints else np.nan, dtype=np.int64 if ints else float)
            for i, (row, k) in enumerate(zip(rows, lengths, strict=True)):
                keep = min(len(row), k + 1)
                arr[i, :keep] = row[:keep]
            arrays[key] = xr.DataArray(arr, dims=("example", "step"))
        elif all(v == values[0] for v in values):
            try:
                attrs[f"decode_{key}"] = json.loads(json.dumps(values[0]))
            except TypeError:
                continue
    return arrays, attrs


def _per_step(value: Any, rows: int) -> bool:
    return isinstance(value, list) and all(isinstance(step, list) and len(step) == rows for step in value)


def instrumented(lm: LoadedModel | torch.nn.Module, plan: Any) -> contextlib.AbstractContextManager[Any]:
    """A context in which every forward of ``lm`` (a :class:`~headlab.model.LoadedModel` or the transformers
    model it holds) runs under ``plan`` (a :class:`headlab.Plan`: its edits apply, its probes record); it
    yields the :class:`headlab.Recording`. ``plan=None``: a no-op context that yields None.

    For forwards :func:`headlab.forward` does not run (a step of a decoding loop, ``model.generate``)::

        with instrumented(lm, Plan(probes=Probes(argmax=True))) as rec:
            lm.model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask))
        rec.to_xarray("argmax")
    """
    if plan is None:
        return contextlib.nullcontext()

    return instrument(lm.model if isinstance(lm, LoadedModel) else lm, plan)


class DecodeState:
    """A batch of prompts being decoded with a KV cache: everything :func:`decode_loop` keeps between steps.

    A step feeds :attr:`input_ids` (with :attr:`attention_mask`, :attr:`positions` and :attr:`cache`) to the
    model; a strategy chooses one token per prompt from the step's :attr:`outputs`; :meth:`record` stores
    the tokens and finds the prompts that end (EOS, stop strings); :meth:`advance` prepares the next
    step. Rows are left-padded and position ids follow the attention mask, so a padded prompt decodes
    exactly like the same prompt alone.

    The request has ``B`` prompts; the model may run ``copies`` rows per prompt (``rows``: ``copies * B``
    left-padded rows, copy-major: row ``r + c * B`` is copy ``c`` of prompt ``r``), and the token chosen for
    a prompt is fed to all its copies. With ``drop_finished`` a prompt that has finished leaves the batch
    and the KV cache after its last step (the others decode exactly as they would with it).

    Attributes, for ``choose`` and the hooks of :func:`decode_loop`:

    - ``request`` (:class:`DecodeRequest`); ``stop`` its stop strings; ``eos`` the EOS ids (a tensor, from
      :attr:`headlab.model.LoadedModel.eos_ids`); ``pad_id`` (:attr:`~headlab.model.LoadedModel.pad_id`).
    - ``step``: tokens generated so far; ``generated`` ``(B, step)`` the tokens of every prompt, ``pad_id``
      once a prompt has finished; ``active`` ``(B, step)``: whether the prompt was still generating at each
      step (the step that chose EOS or completed a stop string included); ``finished`` ``(B,)``.
    - ``rows``: the prompts (indices into the ``B``) the model runs, in order: all of them, or with
      ``drop_finished`` those not finished. ``outputs`` hold ``copies * len(rows)`` rows and ``choose``
      returns one token per entry of ``rows``.
    - ``input_ids``, ``attention_mask``, ``positions``: the inputs of the next forward; ``cache``: the KV
      cache (None before the first forward); ``outputs``: what the last forward returned.
    """

    def __init__(self, request: DecodeRequest, rows: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                 drop_finished: bool = False) -> None:
        batch = request.batch
        ids, mask = rows if rows is not None else (batch.input_ids, batch.attention_mask)
        if ids.shape[0] % batch.size:
            raise ValueError(f"rows: {ids.shape[0]} forward rows is not a multiple of {batch.size} prompts")
        B, dev = batch.size, mask.device
        self.request = request
        self.copies = int(ids.shape[0] // B)
        self.drop_finished = drop_finished
        self.stop = list(request.stop)
        self.pad_id = request.lm.pad_id
        self.eos = torch.tensor(request.lm.eos_ids, dtype=torch.long, device=dev)
        self.input_ids = ids
        self.attention_mask = mask
        if batch.has_images and (ids.shape[1] != batch.length or not torch.equal(ids, batch.input_ids.repeat(
                self.copies, 1))):
            raise ValueError("decode: rows other than copies of the batch cannot carry its images")
        self.positions = batch.positions(self.copies)
        self.cache: Any = None
        self.outputs: Any = None
        self.step = 0
        self.generated = torch.empty((B, 0), dtype=torch.long, device=dev)
        self.active = torch.empty((B, 0), dtype=torch.bool, device=dev)
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
        self.rows = torch.arange(B, device=dev)

    @property
    def done(self) -> bool:
        """Every prompt has finished, or ``max_new_tokens`` tokens were generated."""
        return self.step >= self.request.max_new_tokens or bool(self.finished.all())

    def split_prompt(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, position_ids)`` of the prompt rows without their last token, to
        prefill; the last prompt token becomes the next input (its step attends to the whole prompt)."""
        if self.cache is not None or self.step:
            raise ValueError("DecodeState.split_prompt: only before the first forward")
        ids, mask, pos = self.input_ids, self.attention_mask, self.positions
        self.input_ids, self.positions = ids[:, -1:], pos[..., -1:]
        return ids[:, :-1], mask[:, :-1], pos[..., :-1]

    def record(self, tokens: torch.Tensor) -> None:
        """Store the tokens chosen at this step, one per entry of :attr:`rows` (a prompt that has finished
        gets ``pad_id``), and mark the prompts that end with it: EOS, or a stop string in their text."""
        B = self.finished.shape[0]
        tokens = tokens.to(self.generated.device)
        active = ~self.finished
        if self.rows.shape[0] == B:
            column = torch.where(active, tokens, torch.full_like(tokens, self.pad_id))
        else:
            column = torch.full((B,), self.pad_id, dtype=tokens.dtype, device=tokens.device)
            column[self.rows] = torch.where(active[self.rows], tokens, torch.full_like(tokens, self.pad_id))
        self.generated = torch.cat([self.generated, column[:, None]], dim=1)
        self.active = torch.cat([self.active, active[:, None]], dim=1)
        self.step += 1
        if self.eos.numel():
            self.finished |= torch.isin(column, self.eos)
        tok = self.request.lm.tokenizer
        if self.stop and tok is not None:
            for r in (~self.finished).nonzero().flatten().tolist():
                text = tok.decode(self.generated[r], skip_special_tokens=True)
                self.finished[r] = any(s in text for s in self.stop)

    def advance(self) -> None:
        """Prepare the next forward: with ``drop_finished`` the finished prompts leave the batch and the
        cache; every remaining row is fed the token chosen for its prompt; the mask and the positions
        grow by one."""
        mask, pos = self.attention_mask, self.positions
        if self.drop_finished:
            keep = (~self.finished[self.rows]).nonzero().flatten()
            n = self.rows.shape[0]
            if keep.shape[0] < n:
                idx = torch.cat([keep + c * n for c in range(self.copies)])
                _select_rows(self.cache, idx)
                self.rows = self.rows[keep]
                mask, pos = mask[idx], pos.index_select(-2, idx)
        last = self.generated[:, -1] if self.rows.shape[0] == self.finished.shape[0] else \
            self.generated[self.rows, -1]
        self.input_ids = (last.repeat(self.copies) if self.copies > 1 else last)[:, None]
        self.attention_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        self.positions = pos[..., -1:] + 1

    def tokens(self) -> list[list[int]]:
        """Per prompt, the tokens it generated, up to its first EOS (excluded)."""
        eos = set(self.eos.tolist())
        out = []
        for row, act in zip(self.generated.tolist(), self.active.tolist(), strict=True):
            toks = [t for t, a in zip(row, act, strict=True) if a]
            end = next((i for i, t in enumerate(toks) if t in eos), len(toks))
            out.append(toks[:end])
        return out

    def texts(self, tokens: list[list[int]] | None = None) -> list[str]:
        """Per prompt, the text of :meth:`tokens` (special tokens skipped), cut at the first stop string;
        token ids joined by spaces when the model has no tokenizer."""
        tok = self.request.lm.tokenizer
        tokens = self.tokens() if tokens is None else tokens
        if tok is None:
            return [" ".join(map(str, t)) for t in tokens]
        out = []
        for t in tokens:
            text = tok.decode(t, skip_special_tokens=True)
            out.append(text[:min((text.index(s) for s in self.stop if s in text), default=len(text))])
        return out

    def decoded(self) -> Decoded:
        """The :class:`Decoded` result: :meth:`tokens` and :meth:`texts`."""
        tokens = self.tokens()
        return Decoded(tokens, self.texts(tokens))


def _select_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep the rows ``index`` of a KV cache (or of each cache of a tuple, e.g. an expert's and an amateur's)."""
    if isinstance(cache, (tuple, list)):
        for part in cache:
            _select_rows(part, index)
    elif cache is not None:
        cache.batch_select_indices(index)


Choose = Callable[[Any, DecodeState], torch.Tensor]
"""``choose(outputs, state) -> tokens``: one token id per prompt of ``state.rows``, from the step's model
outputs (``outputs.logits[:, -1]``: the next-token logits of every forward row)."""


@dataclass(frozen=True)
class Rows:
    """Which rows the model runs at each step of :func:`decode_loop`; the default is one row per prompt of
    the request's batch, every row until the loop ends.

    ``input_ids`` and ``attention_mask`` (both or neither): ``k * B`` left-padded forward rows for the ``B``
    prompts, copy-major (row ``r + c * B`` continues prompt ``r``; the token chosen for prompt ``r`` is fed
    to all its rows). ``outputs`` then have ``k * B`` rows and ``choose`` still returns ``B`` tokens: several
    versions of each prompt decoded in one batch (a base and an edited copy, a prompt with and without its
    context).

    ``drop_finished``: a prompt that has finished leaves the batch and the KV cache after its last step;
    ``outputs`` and ``choose``'s tokens are then over ``state.rows``. The outputs of the others are as
    without it. Not with a plan (its edits are per row) nor ``shared_until``.

    ``shared_until``: the rows are ``k`` identical copies of the batch whose plan edits differ only from
    this layer on, so the layers below it run once on one copy (:func:`headlab.shared_trunk`); with a
    :class:`PromptSplit` the prompt prefix is prefilled once and its cache repeated. Outputs are those of
    the ``k * B`` rows, as without it.
    """

    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    drop_finished: bool = False
    shared_until: int | None = None

    def __post_init__(self) -> None:
        if (self.input_ids is None) != (self.attention_mask is None):
            raise ValueError("Rows: give input_ids and attention_mask together, or neither")

    @property
    def given(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(input_ids, attention_mask)`` when the rows are given, None for the request's batch."""
        if self.input_ids is None or self.attention_mask is None:
            return None
        return self.input_ids, self.attention_mask


@dataclass(frozen=True)
class ModelCall:
    """How every step of :func:`decode_loop` calls the model; the default is the model itself with the
    step's inputs.

    ``kwargs``: extra model arguments for every forward (``{"output_hidden_states": True}`` to read the
    hidden states of every layer). ``forward``: called instead of the model with the same keyword
    arguments (``input_ids``, ``attention_mask``, ``position_ids``, ``cache``, ``use_cache`` and
    ``kwargs``); it returns an object with ``.logits`` and ``.cache`` (e.g. two models stepping together,
    each with its own cache). ``around(state)``: a context manager entered around the model call of every
    step (the prefill of a :class:`PromptSplit` excluded), e.g. a :func:`headlab.instrument` context whose
    probes follow ``state.rows``; ``state.step`` is the index of the token being produced.
    """

    kwargs: Mapping[str, Any] = field(default_factory=dict)
    forward: Callable[..., Any] | None = None
    around: Callable[[DecodeState], contextlib.AbstractContextManager[Any]] | None = None


@dataclass(frozen=True)
class PromptSplit:
    """Prefill the prompt without its last token first; the last prompt token is then the input of the
    first step (which attends to the whole prompt). Prompts of one token are not split.

    ``then()``: called between the prefill and the first step, e.g. to add edits to the plan that act from
    the last prompt token on only. ``cache``: ``cache(model, input_ids, attention_mask, position_ids,
    **image_inputs) -> cache`` computes the prefix's KV cache instead of a forward of the model (e.g.
    :func:`prefill`, one unpadded row at a time on a CPU); it runs the bare model, so not with a plan or a
    :attr:`ModelCall.forward`, nor with :attr:`Rows.shared_until`, and every prompt needs two tokens.
    """

    then: Callable[[], None] | None = None
    cache: Callable[..., Any] | None = None


def decode_loop(request: DecodeRequest | DecodeState, choose: Choose, *, rows: Rows | None = None,
                call: ModelCall | None = None, split: PromptSplit | None = None,
                on_step: Callable[[DecodeState], None] | None = None) -> Decoded:
    """headlab's KV-cache decoding loop: prefill, then one token per step chosen by ``choose(outputs, state)``.

    Every decoding strategy and every detector that decodes runs this loop. A step runs the model on the
    next inputs (the whole prompt at the first step), calls ``choose`` with the model outputs and the
    :class:`DecodeState` (``state.generated``, ``state.step``, ``state.rows``, ...), and records the tokens
    it returns, one per prompt. A prompt stops at EOS (:attr:`~headlab.model.LoadedModel.eos_ids`) or when
    its text contains a stop string; the loop stops when every prompt has, or after
    ``request.max_new_tokens`` tokens. The request's steering plan applies to every forward. Returns
    :class:`Decoded` (tokens up to EOS, texts cut at the first stop string). A strategy is a ``choose``::

        def decode(config, request):  # greedy that never repeats the previous token
            def choose(outputs, state):
                logits = outputs.logits[:, -1].clone()
                if state.step:
                    last = state.generated[state.rows, -1]
                    logits[torch.arange(len(last)), last] = -torch.inf
                return logits.argmax(-1)
            return decode_loop(request, choose)

    ``request`` may be a :class:`DecodeState` built beforehand (its rows given to the state), to read it
    after the loop (``generated``, ``active``). The options, each a small dataclass whose defaults are the
    plain loop:

    - ``rows`` (:class:`Rows`): other forward rows than one per prompt (copies of the batch), finished
      prompts leaving the batch, layers shared by identical copies;
    - ``call`` (:class:`ModelCall`): extra model arguments, a function run instead of the model, a context
      around every step's forward;
    - ``split`` (:class:`PromptSplit`): prefill the prompt without its last token first, with a callback
      between the two parts or a function that computes the prefix cache;
    - ``on_step(state)``: called after every step, once its tokens are recorded (``state.generated[:, -1]``)
      and before finished prompts leave the batch.
    """
    call = call or ModelCall()
    if isinstance(request, DecodeState):
        if rows is not None:
            raise ValueError("decode_loop: rows are options of a new state; give them to DecodeState "
                             "(shared_until: pass the request)")
        state: DecodeState | None = request
        request = request.request
    else:
        state = None
    rows = rows or Rows()
    lm, batch = request.lm, request.batch
    model = lm.model
    run = call.forward or model
    kwargs = dict(call.kwargs)
    prefill_cache = split.cache if split is not None else None
    trunk = None
    if state is None:
        forward_rows = rows.given
        input_ids, mask = forward_rows if forward_rows is not None else (batch.input_ids, batch.attention_mask)
        if input_ids.shape[0] % batch.size:
            raise ValueError(f"rows: {input_ids.shape[0]} forward rows is not a multiple of {batch.size} prompts")
        copies = input_ids.shape[0] // batch.size
        trunk = rows.shared_until if rows.shared_until is not None and copies > 1 else None
        if trunk is not None:
            if call.forward is not None or rows.drop_finished or prefill_cache is not None:
                raise ValueError("decode_loop: shared_until runs the model itself; it cannot take a forward "
                                 "function, a prefill function or drop_finished")
            B = batch.size
            if not (torch.equal(input_ids, input_ids[:B].repeat(copies, 1))
                    and torch.equal(mask, mask[:B].repeat(copies, 1))):
                raise ValueError("decode_loop: shared_until needs rows that are identical copies of the batch")
            forward_rows = (input_ids[:B], mask[:B])  # the model runs copy 0; shared_trunk repeats it at `trunk`
        state = DecodeState(request, forward_rows, drop_finished=rows.drop_finished)
    else:
        copies = state.copies
    if state.drop_finished and request.plan is not None:
        raise ValueError("decode_loop: drop_finished cannot be used with a plan (its edits are per row)")
    if prefill_cache is not None:
        if call.forward is not None or request.plan is not None:
            raise ValueError("decode_loop: a prefill function runs the bare model; not with forward or a plan")
        if state.input_ids.shape[1] < 2:
            raise ValueError("decode_loop: a prefill function needs prompts of at least 2 tokens")
    splitting = prefill_cache is not None or (split is not None and state.input_ids.shape[1] > 1)
    # the processor inputs (images) go to the first forward over the prompt only
    first = batch.forward_inputs(1 if trunk is not None else copies) if batch.has_images and state.step == 0 \
        else {}

    def trunk_at(layer: int | None) -> contextlib.AbstractContextManager[Any]:

        return contextlib.nullcontext() if layer is None else shared_trunk(model, layer, copies)

    with torch.no_grad(), instrumented(lm, request.plan):
        if splitting:
            ids, mask, pos = state.split_prompt()
            if prefill_cache is not None:
                state.cache = prefill_cache(model, ids, mask, pos, **first)
            else:
                with trunk_at(None if trunk is None else lm.geometry.n_layers):
                    state.cache = run(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                      **kwargs, **first).cache
                if trunk is not None:

                    expand_cache(state.cache, trunk, copies)
            first = {}
            if split is not None and split.then is not None:
                split.then()
        with trunk_at(trunk):
            while state.step < request.max_new_tokens:
                with call.around(state) if call.around is not None else contextlib.nullcontext():
                    out = run(input_ids=state.input_ids, attention_mask=state.attention_mask,
                              position_ids=state.positions, cache=state.cache, use_cache=True, **kwargs, **first)
                first = {}
                state.outputs, state.cache = out, out.cache
                state.record(choose(out, state))
                if on_step is not None:
                    on_step(state)
                if state.done:
                    break
                state.advance()
    return state.decoded()


def prefill(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            *, per_row: bool | None = None, **forward_kwargs: Any) -> Any:
    """The KV cache of a left-padded batch of prompts, computing no logits beyond the last position.

    ``per_row`` (default: on a CPU) runs each row on its own tokens, without its padding, and stacks the
    caches left-padded with zeros (keys the attention mask hides): a single unpadded row takes SDPA's
    causal kernel, where a padded batch needs a masked one that is slower on a CPU. Same cache as the
    batched prefill up to float rounding. Models whose cache has layers other than plain growing ones
    (sliding windows, static or quantised caches) are prefilled batched, and so are batches with
    ``forward_kwargs`` (processor inputs such as ``pixel_values``, passed to the model).
    """

    def run(**kw: Any) -> Any:
        try:
            return model(**kw, **forward_kwargs, use_cache=True, logits_to_keep=1)
        except TypeError:  # a model without logits_to_keep
            return model(**kw, **forward_kwargs, use_cache=True)

    B, n = input_ids.shape
    if per_row is None:
        per_row = input_ids.device.type == "cpu" and B > 1 and not forward_kwargs
    pads = (attention_mask == 0).sum(-1).tolist()
    if per_row and not forward_kwargs and all(bool(attention_mask[r, p:].all()) and p < n for r, p in enumerate(pads)):
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
    """Per row: the summed score of the continuation tokens, the per-token scores, and whether every
    continuation token is the strategy's top-scoring token at its position (``greedy``; empty when a
    scorer does not say, :func:`sum_continuation` fills it)."""

    logprobs: list[float]
    tokens: list[list[float]] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)


def continuation_batch(lm: LoadedModel, pairs: list[tuple[Example, str | list[int]]], device: str | None = None,
                       ) -> tuple[Batch, list[int]]:
    """Tokenize ``prompt + continuation`` rows; the continuation is what follows the prompt's own tokens.

    As in the DoLa and DeCoRe reference code (and lm-evaluation-harness), the continuation tokens of a
    text row are the tokens of the full text after the first ``len(tokenize(prompt))`` ones. A row whose
    example has ``input_ids``, or whose continuation is a list of token ids, is the prompt's ids (its
    ``input_ids`` or its tokenized text) followed by the continuation's ids (a text continuation is
    tokenized without special tokens). Returns the batch (its :attr:`Batch.continuation` set) and the
    number of continuation tokens per row.
    """
    tok = lm.tokenizer
    rows: list[Example] = []
    n_tokens = []
    for ex, cont in pairs:
        if ex.input_ids is None and isinstance(cont, str):
            if tok is None:
                raise ValueError("scoring text needs a tokenizer (the model has none); give token ids")
            row = Example(prompt=ex.prompt + cont, spans=ex.spans, meta=ex.meta, images=ex.images)
            full = len(tok(row.prompt, add_special_tokens=True)["input_ids"])
            prefix = len(tok(ex.prompt, add_special_tokens=True)["input_ids"])
            n = full - prefix
        else:
            if ex.input_ids is not None:
                head = list(ex.input_ids)
            elif tok is None:
                raise ValueError("scoring text needs a tokenizer (the model has none); give token ids")
            else:
                head = list(tok(ex.prompt, add_special_tokens=True)["input_ids"])
            if isinstance(cont, str):
                if tok is None:
                    raise ValueError("a text continuation needs a tokenizer (the model has none); give token ids")
                tail = list(tok(cont, add_special_tokens=False)["input_ids"])
            else:
                tail = [int(t) for t in cont]
            row = Example(prompt=ex.prompt, input_ids=head + tail, spans=ex.spans, meta=ex.meta)
            if ex.images:
                raise ValueError("scoring a token-id continuation of an example with images is not supported; "
                                 "give the continuation as text")
            n = len(tail)
        if n < 1:
            raise ValueError(f"continuation adds no token to the prompt {ex.prompt[-40:]!r}")
        rows.append(row)
        n_tokens.append(n)
    batch = tokenize(lm, rows, device)
    batch.continuation = list(n_tokens)
    return batch, n_tokens


def sum_continuation(scores: torch.Tensor, request: ScoreRequest) -> Scored:
    """Gather ``scores`` (rows, C, V), the strategy's per-token scores at the C positions that predict the
    continuation (``logits[:, -C-1:-1]``), at the continuation tokens, and sum each row's own tokens.
    ``greedy[r]``: every continuation token of row ``r`` is the argmax of its position's scores (what
    lm-evaluation-harness calls ``is_greedy``)."""
    ids, valid = request.targets()
    scores = scores.float()
    picked = scores.gather(-1, ids[..., None])[..., 0]
    top = (scores.argmax(-1) == ids) | ~valid
    per_token = [picked[r][valid[r]].tolist() for r in range(picked.shape[0])]
    return Scored([float(sum(t)) for t in per_token], per_token, [bool(g) for g in top.all(-1).tolist()])
