"""Retrieval heads: Wu et al.'s retrieval score, batched, through the streaming argmax probe.

Definition: docs/methods.md#retrieval-score. For every example with a needle span ``[s, e)`` (token
positions of the needle in the prompt) the model decodes greedily. At decode step ``t`` with generated
token ``w_t`` every head ``(l, h)`` takes its top-1 key ``i* = argmax A[l,h][t]`` of the single decode query; when
``s <= i* < e`` and ``prompt_ids[i*] == w_t`` (the head copy-pastes the token it attends to) the head's
score for this instance grows by ``1 / (e - s)``. An instance counts only if the model retrieved the
needle (ROUGE-1 recall of the output > 0.5); the score of a head is the mean over counted instances,
and heads with score >= 0.1 are retrieval heads.

As in the reference code, the prompt minus its last token is prefilled with fast attention (here:
plain SDPA, nothing recorded), and decoding starts by feeding the last prompt token, so the first
scored query is the last prompt token and every generated token is scored with the attention of the
query that produced it. Decoding runs for a whole batch at once (left padding; position ids follow
the mask) inside one :func:`headlab.instrument.instrument` context whose only probe is ``argmax``:
no attention matrix is ever stored, a decode step costs one streaming pass over the keys.

Outputs (``xarray.Dataset``): ``score (layer, head)``; ``example_score (example, layer, head)``
(every instance, retrieved or not); ``retrieved (example)``; ``recall (example)`` (ROUGE-1 recall
that decides it); ``output (example)`` (the generated text); ``needle_start``, ``needle_end``
``(example)``: the needle's token span ``[s, e)`` in the prompt's token ids (:func:`needle_tokens`);
``retrieval_head (layer, head)`` (``score >= threshold``). Import/export of the reference JSON format ``{"<layer>-<head>": [score per
retrieved instance]}``: :func:`write_retrieval_json`, :func:`read_retrieval_json`, and the config
options ``export`` and ``load``.

The needle-retrieved test: the reference code computes ``rouge_scorer(['rouge1'], use_stemmer=True)
.score(needle, response).recall > 0.5`` against the whole needle sentence because its prompts ask
the model to repeat it; headlab's ``niah`` prompts ask a question whose answer is a phrase of the
needle, so the default reference text is the answer (``meta["answer"]``, else the target);
``reference: needle`` reproduces the reference code exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab import Geometry, from_retrieval_json, span_tensor, to_retrieval_json
from headlab.generation import ModelCall, PromptSplit, prefill
from headlab.masking import length_batches
from headlab.plugin import (
    Batch,
    ComponentConfig,
    DecodeRequest,
    DecodeState,
    Example,
    FiniteFloat,
    LoadedModel,
    NonEmptyStr,
    NonNegativeFloat,
    Plan,
    PositiveInt,
    Probability,
    Probes,
    StepContext,
    decode_loop,
    head_array,
    hookimpl,
    instrumented,
    tokenize,
)
from headlab.resources import Estimate, EstimateContext
from headlab.text import rouge1

__all__ = [
    "ProbeDecode",
    "Retrieval",
    "StepRecords",
    "detect",
    "length_batches",
    "probe_decode",
    "read_retrieval_json",
    "retrieval_scores",
    "write_retrieval_json",
]


class Retrieval(ComponentConfig):
    """Retrieval heads (Wu et al. 2024): heads that copy the needle token they attend to."""

    kind: Literal["retrieval"] = "retrieval"
    span: NonEmptyStr = Field("needle", description="name of the examples' character span holding the needle")
    max_new_tokens: PositiveInt = Field(50, description="greedy decoding length (reference: 50)")
    stop: list[NonEmptyStr] = Field(default_factory=list, description="stop strings (the reference stops at a newline)")
    batch_size: PositiveInt = Field(16, description="examples decoded together (sorted by length)")
    length_slack: NonNegativeFloat = Field(0.125, description="a batch holds prompts at most this fraction longer "
                                "than its shortest (left padding costs compute)")
    threshold: FiniteFloat = Field(0.1, description="heads with score >= threshold are retrieval heads (paper: 0.1)")
    recall_threshold: Probability = Field(0.5,
                                    description="an instance counts when ROUGE-1 recall > this (reference: 0.5)")
    reference: Literal["answer", "needle", "target"] = Field(
        "answer", description="text the output's ROUGE-1 recall is measured against: the answer "
        "(meta['answer'], else target), the needle sentence (the reference code), or the target")
    stemmer: bool = Field(True, description="Porter stemming in ROUGE (reference: use_stemmer=True)")
    export: str | None = Field(None, description="write the scores to this JSON file in the reference "
                               "format {\"<layer>-<head>\": [score per retrieved instance]}")
    load: str | None = Field(None, description="read scores from a reference-format JSON file instead of "
                             "detecting (published head lists); example_score then has no example axis")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """The KV cache of a batch decoding ``max_new_tokens`` after the longest prompt (resource guard)."""
        return [ctx.kv_cache(ctx.task.tokens + self.max_new_tokens, ctx.rows(self.batch_size))]


# --------------------------------------------------------------------------- decoding with probes
@dataclass
class ProbeDecode:
    """What :func:`probe_decode` returns.

    ``generated`` (B, T) token ids (pad after a row finished); ``active`` (B, T) bool, True for the steps
    a row really generated (the step that produced EOS or completed a stop string included);
    ``recording`` the probes of the decode steps by name (``argmax``, ``span_mass``, ``z``, ... as in
    :data:`headlab.instrument.DIMS`, attributes or ``recording["argmax"]``) with the batch axis over all
    B rows and the query (or position) axis over decode steps ``t`` (query at absolute position
    ``N - 1 + t`` for a prompt of padded length ``N``); entries of inactive steps are -1 (``argmax``) or 0;
    ``texts`` the decoded outputs (special tokens skipped, cut at stop strings); ``tokens`` the generated
    ids per row up to EOS.
    """

    generated: torch.Tensor
    active: torch.Tensor
    recording: Any
    texts: list[str]
    tokens: list[list[int]]


class StepRecords(dict):
    """Probe arrays of a :func:`probe_decode`, by name; also readable as attributes (``rec.argmax``)."""

    def __getattr__(self, name: str) -> torch.Tensor | None:
        return self.get(name)


def probe_decode(lm: LoadedModel, batch: Batch, probes: Any, max_new_tokens: int,
                 stop: Sequence[str] = ()) -> ProbeDecode:
    """Greedy decoding of a batch with ``probes`` recorded at every decode query, none at the prefill.

    Runs :func:`headlab.generation.decode_loop`: the prompt minus its last token is prefilled outside any
    instrumentation (SDPA; on a CPU one unpadded row at a time, :func:`headlab.generation.prefill`), then
    the last prompt token and each generated token are fed one at a time, each step inside an
    ``instrument`` context with ``Plan(probes=probes)``. Rows leave the batch (and the KV cache) as soon as
    they finish (``drop_finished``), so a long output does not make the finished rows decode on. Key
    positions in the recording are absolute (left-padded) positions: every decode step sees the whole
    cache. Per-row probe ``spans`` (a list per row or a (B, P, 2) tensor) follow their rows.
    """

    if batch.length < 2:
        raise ValueError("probe_decode needs prompts of at least 2 tokens")
    B = batch.size
    spans = None if probes.spans is None else span_tensor(probes.spans, B, batch.input_ids.device)
    store: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def probed(state: DecodeState):
        rows = state.rows
        step_probes = probes if spans is None else dataclasses.replace(probes, spans=spans[rows])
        with instrumented(lm, Plan(probes=step_probes)) as rec:
            yield
        for name, value in rec.as_dict().items():  # (rows, layer, head, 1, ...) -> step t of the rows
            if name not in store:
                shape = (B, *value.shape[1:3], max_new_tokens, *value.shape[4:])
                fill = -1 if name == "argmax" else 0
                store[name] = torch.full(shape, fill, dtype=value.dtype, device=value.device)
            store[name][rows.to(value.device), :, :, state.step] = value[:, :, :, -1]

    state = DecodeState(DecodeRequest(lm, batch, max_new_tokens, list(stop)), drop_finished=True)
    decoded = decode_loop(state, lambda out, _: out.logits[:, -1].argmax(-1), split=PromptSplit(cache=prefill),
                          call=ModelCall(around=probed))
    steps = state.step
    rec = StepRecords({name: value[:, :, :, :steps] for name, value in store.items()})
    return ProbeDecode(state.generated, state.active, rec, decoded.texts, decoded.tokens)


# --------------------------------------------------------------------------- the score
def copy_paste_hits(argmax: torch.Tensor, sequence: torch.Tensor, generated: torch.Tensor,
                    active: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """Per (row, layer, head, step): the top-1 key is inside the needle span and holds the generated token.

    ``argmax`` (B, L, H, T) absolute key positions of the decode queries; ``sequence`` (B, >= max key + 1)
    token ids by absolute position (prompt, then generated); ``generated`` (B, T); ``active`` (B, T);
    ``spans`` (B, 2) needle ``[s, e)``. Returns a bool tensor (B, L, H, T).
    """
    B, L, H, T = argmax.shape
    key = argmax.clamp(min=0)
    at_key = sequence.gather(1, key.reshape(B, -1)).reshape(B, L, H, T)
    s = spans[:, 0].view(B, 1, 1, 1)
    e = spans[:, 1].view(B, 1, 1, 1)
    in_span = (argmax >= s) & (argmax < e)
    return in_span & (at_key == generated[:, None, None, :]) & active[:, None, None, :]


def retrieval_scores(lm: LoadedModel, examples: Sequence[Example], *, span: str = "needle",
                     max_new_tokens: int = 50, stop: Sequence[str] = (), batch_size: int = 16,
                     length_slack: float = 0.125, progress: Any = None) -> tuple[np.ndarray, list[str]]:
    """Per-instance retrieval scores ``(example, layer, head)`` and the generated texts.

    Examples are decoded up to ``batch_size`` at a time, grouped by prompt length (:func:`length_batches`;
    results come back in the examples' order). ``progress(iterable, description)`` wraps the batch loop when given.
    """
    geo = lm.geometry
    for i, ex in enumerate(examples):
        if not ex.spans.get(span):
            raise ValueError(f"retrieval: example {i} has no '{span}' span (use a task whose examples mark "
                             f"the needle, e.g. niah, or set `span:`)")
    lengths = [len(ex.input_ids) if ex.input_ids is not None else
               len(lm.tokenizer(ex.prompt)["input_ids"]) for ex in examples]
    chunks = length_batches(lengths, batch_size, length_slack)
    scores = np.zeros((len(examples), geo.n_layers, geo.n_heads))
    texts = [""] * len(examples)
    it = progress(chunks, "retrieval heads") if progress is not None else chunks
    for idx in it:
        batch = tokenize(lm, [examples[i] for i in idx])
        needle = torch.tensor([batch.token_span(r, *examples[i].spans[span][0]) for r, i in enumerate(idx)],
                              dtype=torch.long, device=batch.input_ids.device)
        dec = probe_decode(lm, batch, Probes(argmax=True), max_new_tokens, stop)
        sequence = torch.cat([batch.input_ids, dec.generated], dim=1)
        hits = copy_paste_hits(dec.recording.argmax, sequence, dec.generated, dec.active, needle)
        per = hits.sum(-1).double() / (needle[:, 1] - needle[:, 0]).double().view(-1, 1, 1)
        per = per.cpu().numpy()
        for r, i in enumerate(idx):
            scores[i] = per[r]
            texts[i] = dec.texts[r]
    return scores, texts


def needle_tokens(lm: LoadedModel, examples: Sequence[Example], span: str = "needle") -> tuple[np.ndarray, np.ndarray]:
    """Per example, the needle's token span ``[start, end)`` the scores were computed on: positions in the
    example's prompt token ids (unpadded, from 0; the ``token`` dimension of the step's ``input_ids``)."""
    start = np.zeros(len(examples), dtype=np.int64)
    end = np.zeros(len(examples), dtype=np.int64)
    for i, ex in enumerate(examples):
        batch = tokenize(lm, [ex], device="cpu")
        s, e = batch.token_span(0, *ex.spans[span][0])
        start[i], end[i] = s - batch.pad[0], e - batch.pad[0]
    return start, end


def _reference_text(ex: Example, which: str, span: str, i: int) -> str:
    if which == "needle":
        s, e = ex.spans[span][0]
        return ex.prompt[s:e]
    if which == "answer" and isinstance(ex.meta.get("answer"), str):
        return ex.meta["answer"]
    if ex.target is None:
        raise ValueError(f"retrieval: example {i} has no target to measure retrieval against")
    return ex.target


def _dataset(per_example: np.ndarray, retrieved: np.ndarray, geo: Geometry) -> xr.Dataset:
    kept = per_example[retrieved]
    mean = kept.mean(0) if len(kept) else np.zeros(per_example.shape[1:])
    return xr.Dataset({"score": head_array(mean),
                       "example_score": head_array(per_example, "example"),
                       "retrieved": ("example", retrieved.astype(bool))})


def detect(config: Retrieval, ctx: StepContext) -> xr.Dataset:
    """The ``retrieval`` detector (see the module docstring)."""
    geo = ctx.model.geometry
    if config.load is not None:
        ds = read_retrieval_json(config.load, geo)
    else:
        scores, texts = retrieval_scores(ctx.model, ctx.examples, span=config.span,
                                         max_new_tokens=config.max_new_tokens, stop=config.stop,
                                         batch_size=config.batch_size, length_slack=config.length_slack,
                                         progress=ctx.progress)
        recall = np.array([rouge1(_reference_text(ex, config.reference, config.span, i), out.strip(),
                                  config.stemmer)[1] for i, (ex, out) in enumerate(zip(ctx.examples, texts,
                                                                                       strict=True))])
        retrieved = recall > config.recall_threshold
        if not retrieved.any():
            warnings.warn("retrieval: the model retrieved no needle; every score is 0", stacklevel=2)
        ds = _dataset(scores, retrieved, geo)
        ds["recall"] = ("example", recall)
        ds["output"] = ("example", np.array(texts, dtype=object))
        start, end = needle_tokens(ctx.model, ctx.examples, config.span)
        ds["needle_start"], ds["needle_end"] = ("example", start), ("example", end)
        ds.attrs["n_retrieved"] = int(retrieved.sum())
    ds["retrieval_head"] = ds["score"] >= config.threshold
    ds.attrs.update(method="retrieval", model=ctx.model.name, threshold=config.threshold,
                    n_retrieval_heads=int(ds["retrieval_head"].sum()),
                    reference="docs/methods.md#retrieval-score")
    if config.export is not None:
        write_retrieval_json(ds, config.export)
    return ds


# --------------------------------------------------------------------------- reference JSON format
def write_retrieval_json(ds: xr.Dataset, path: str | Path) -> Path:
    """Write a retrieval result in the reference format ``{"<layer>-<head>": [score per instance]}``.

    As in the reference code, only retrieved instances are listed (``retrieved`` when the dataset has
    it). A dataset with only ``score (layer, head)`` is written with one value per head.
    """
    if "example_score" in ds and "example" in ds["example_score"].dims:
        per = ds["example_score"]
        if "retrieved" in ds:
            per = per.isel(example=np.asarray(ds["retrieved"].values, dtype=bool))
    else:
        per = ds["score"]
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(to_retrieval_json(per)))
    return p


def read_retrieval_json(path: str | Path, geometry: Geometry | None = None) -> xr.Dataset:
    """A reference-format JSON file as a dataset: ``score (layer, head)`` = mean per head.

    Heads missing from the file score 0. ``geometry`` (the model's) fixes the array shape and checks
    that every head of the file exists; without it the shape is the largest layer/head in the file.
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not all("-" in str(k) for k in data):
        raise ValueError(f"{path}: not a retrieval-head JSON file ({{\"<layer>-<head>\": [scores]}})")
    means = from_retrieval_json(data)
    n_layers = geometry.n_layers if geometry else 1 + max(layer for layer, _ in means)
    n_heads = geometry.n_heads if geometry else 1 + max(head for _, head in means)
    score = np.zeros((n_layers, n_heads))
    for (layer, head), value in means.items():
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise ValueError(f"{path}: head {layer}-{head} is outside this model ({n_layers} layers x "
                             f"{n_heads} heads)")
        score[layer, head] = value
    ds = xr.Dataset({"score": head_array(score)})
    ds.attrs["source"] = str(path)
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(Retrieval, detect)
