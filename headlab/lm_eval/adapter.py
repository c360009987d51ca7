"""The model adapter: :class:`HeadlabLM`, lm-eval's ``LM`` backed by headlab's scorer, decoder and steering.

``loglikelihood`` and ``loglikelihood_rolling`` run through :func:`headlab.logprobs`, ``generate_until``
through :func:`headlab.generate`, with the steering methods' edits applied in the same forwards.
:data:`HAVE_LM_EVAL` says whether lm-eval is installed, and :func:`require_lm_eval` refuses without it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from ruamel.yaml import YAML

from ..context import Example, StepContext, strip_tags
from ..model import LoadedModel
from ..results import open_run
from ..runner import ModelCache, run_cell
from ..scoring import as_model, component, generate, logprobs
from ..spec import ModelSpec, load_spec
from ..task_code import EXTRA

__all__ = ["DEFAULT_MAX_GEN_TOKS", "HAVE_LM_EVAL", "HeadlabLM", "require_lm_eval"]


try:  # the base class and helpers; without lm-eval the module imports, and using it says which extra to install
    from lm_eval.api.model import LM as _Base
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    HAVE_LM_EVAL = True
except ImportError:  # pragma: no cover - exercised without the extra
    _Base = object  # type: ignore[assignment,misc]
    HAVE_LM_EVAL = False


log = logging.getLogger("headlab.lm_eval")


DEFAULT_MAX_GEN_TOKS = 256


def require_lm_eval() -> None:
    """Raise ``ImportError`` naming the ``eval`` extra when lm-eval is not installed."""
    if not HAVE_LM_EVAL:
        raise ImportError(EXTRA)


def _config_value(value: Any) -> Any:
    """A decode/steer value given as text (lm-eval's ``key=value`` model args): YAML/JSON, or a kind name."""
    if isinstance(value, str):

        loaded = YAML(typ="safe", pure=True).load(value)
        return loaded if loaded is not None else None
    return value


def _batch_size(value: Any) -> int:
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return 8
    return max(1, int(value))


class HeadlabLM(_Base):  # type: ignore[misc,valid-type]
    """An lm-evaluation-harness model running headlab: its model loading, steering and decoding strategies.

    Arguments (all optional; lm-eval passes ``--model_args`` as keywords):

    - ``model`` (or ``pretrained``): a :class:`~headlab.model.LoadedModel`, a registered name
      (``headlab-tiny``, the default), a checkpoint directory, a hub id, or a model-spec mapping.
    - ``decode``: a decoder config (``{kind: dola, layers: high}``, or the kind's name); default greedy.
      ``steer``: a list of steering configs (``[{kind: pasta, heads: ..., missing: skip}]``). Text values are
      read as YAML, so ``--model_args decode=dola`` works; pass mappings as a JSON ``--model_args`` object.
    - ``spec``: a headlab spec file: its model, and the ``decode``/``steer`` of its ``evaluate`` step
      (``step`` names one; default the first). The steps before that one (detectors) run first, on the
      first sweep cell, so ``heads: {from: <step>}`` resolves. ``run``: a stored run whose results resolve
      ``heads: {from: ...}`` instead. ``results`` (Python): step id -> dataset, for the same purpose.
    - ``batch_size`` (``auto`` = 8), ``max_gen_toks`` (256), ``max_length`` (the model's context length),
      ``seed``, ``device`` (a CUDA device is ignored where there is none: lm-eval's command line passes
      ``cuda`` by default), ``dtype``; ``emphasis_tag`` (``em``; ``none`` disables marker removal).

    ``loglikelihood`` returns ``(logprob, is_greedy)`` as lm-eval's ``hf`` model does: the continuation's
    tokens are those of ``context + continuation`` after the context's own (a context's trailing spaces move
    to the continuation), an empty context is the BOS (else EOS) token, and ``is_greedy`` says whether every
    continuation token is the top-scoring token of the strategy (the model's argmax under greedy).
    ``generate_until`` decodes with the configured strategy; a task's ``do_sample: true`` switches the
    default (greedy) decoder to ``sample`` with the task's ``temperature``/``top_k``/``top_p``; an explicit
    ``decode`` always wins.
    """

    def __init__(self, model: Any = None, *, pretrained: Any = None, spec: str | None = None, step: str | None = None,
                 run: str | None = None, decode: Any = None, steer: Any = None, batch_size: Any = 8,
                 max_batch_size: Any = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, max_length: int | None = None,
                 seed: int = 0, device: str | None = None, dtype: str | None = None,
                 results: Mapping[str, Any] | None = None, ctx: StepContext | None = None,
                 emphasis_tag: str | None = "em", **unused: Any) -> None:
        require_lm_eval()
        super().__init__()
        if unused:
            log.warning("headlab model: ignoring model_args %s", sorted(unused))
        self.results: dict[str, Any] = dict(results or {})
        model = model if model is not None else pretrained
        decode, steer = _config_value(decode), _config_value(steer)
        if spec is not None:
            spec_model, spec_decode, spec_steer, spec_results = _from_spec(spec, step, seed)
            model = model if model is not None else spec_model
            decode = decode if decode is not None else spec_decode
            steer = steer if steer is not None else spec_steer
            self.results = {**spec_results, **self.results}
        if run is not None:

            self.results = {**open_run(run).results, **self.results}
        if ctx is not None and model is None:
            model = ctx.model
        if not isinstance(model, LoadedModel):
            model = _model_spec(model, device, dtype)
        self.lm: LoadedModel = as_model(model, seed)
        self.explicit_decode = decode is not None
        self.decode = component("decoders", decode)
        if isinstance(steer, Mapping):
            steer = [steer]
        self.steer = [component("steering", s) for s in (steer or [])]
        self.batch_size_ = _batch_size(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.max_length = int(max_length) if max_length else _max_length(self.lm)
        self.seed = int(seed)
        self.ctx = ctx
        self.tags = {} if emphasis_tag in (None, "", "none", False) else {"emphasis": str(emphasis_tag)}
        self._device = self.lm.device

    # ------------------------------------------------------------------ lm-eval's interface
    @property
    def tokenizer_name(self) -> str:
        return self.lm.name.replace("/", "__")

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context is replaced with: BOS, else EOS (as lm-eval's ``hf`` model)."""
        tok = self.lm.tokenizer
        for value in (getattr(tok, "bos_token_id", None), getattr(tok, "eos_token_id", None)):
            if value is not None:
                return int(value)
        return int(self.lm.pad_id)

    def get_model_info(self) -> dict[str, Any]:
        """Recorded in lm-eval's results ``config``."""
        return {"model_name": self.lm.name, "model_digest": self.lm.digest or "",
                "decode": self.decode.model_dump(mode="json"),
                "steer": [s.model_dump(mode="json") for s in self.steer]}

    def example(self, context: str) -> Example:
        """The context as an :class:`~headlab.Example`: emphasis markers removed and recorded as spans."""
        if not self.tags:
            return Example(prompt=context)
        try:
            text, spans = strip_tags(context, self.tags)
        except ValueError as e:
            log.warning("headlab model: unbalanced emphasis markers left as text (%s)", e)
            return Example(prompt=context)
        return Example(prompt=text, spans=spans)

    def _pairs(self, requests: Sequence[tuple[str, str]]) -> tuple[list[Example], list[Any]]:
        tok = self.lm.tokenizer
        prompts: list[Example] = []
        conts: list[Any] = []
        for context, continuation in requests:
            if context == "":
                ids = tok(continuation, add_special_tokens=False)["input_ids"]
                if ids and ids[0] == self.prefix_token_id:
                    prompts.append(Example(prompt="", input_ids=ids[:1]))
                    conts.append(list(ids[1:]))
                else:
                    prompts.append(Example(prompt="", input_ids=[self.prefix_token_id]))
                    conts.append(list(ids))
                continue
            ex = self.example(context)
            text = ex.prompt
            n_spaces = len(text) - len(text.rstrip())
            if n_spaces:
                continuation = text[-n_spaces:] + continuation
                text = text[:-n_spaces]
                spans = {k: [(s, min(e, len(text))) for s, e in v if s < len(text)] for k, v in ex.spans.items()}
                ex = Example(prompt=text, spans={k: v for k, v in spans.items() if v})
            prompts.append(ex)
            conts.append(continuation)
        return prompts, conts

    def _score(self, prompts: list[Example], conts: list[Any]) -> Any:
        return logprobs(self.lm, prompts, conts, steer=self.steer, decode=self.decode,
                        batch_size=self.batch_size_, seed=self.seed, results=self.results, ctx=self._step_ctx())

    def _step_ctx(self) -> StepContext | None:
        if self.ctx is None:
            return None
        return StepContext(model=self.lm, examples=[], results={**self.ctx.results, **self.results},
                           seed=self.ctx.seed, step_id=self.ctx.step_id, reporter=self.ctx.reporter,
                           cancel=self.ctx.cancel, store=self.ctx.store)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per request, under the decoder's scorer."""
        if not requests:
            return []
        args = [tuple(r.args) for r in requests]
        prompts, conts = self._pairs(args)
        scored = self._score(prompts, conts)
        out = [(float(lp), bool(g)) for lp, g in zip(scored.logprobs, scored.greedy, strict=True)]
        for a, answer in zip(args, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", a, answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text (perplexity tasks), in disjoint windows of ``max_length``
        tokens as lm-eval's ``hf`` model computes it (the first token predicted from the prefix token)."""
        tok = self.lm.tokenizer
        prompts: list[Example] = []
        conts: list[list[int]] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            (text,) = req.args
            ids = tok(text)["input_ids"]
            for context, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=ids, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
                prompts.append(Example(prompt="", input_ids=list(context)))
                conts.append(list(cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        if prompts:
            scored = self._score(prompts, conts)
            for i, lp in zip(owner, scored.logprobs, strict=True):
                totals[i] += float(lp)
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", tuple(req.args), total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generate for each context until a stop string (the task's ``until`` and EOS) or ``max_gen_toks``."""
        if not requests:
            return []
        tok = self.lm.tokenizer
        eos = tok.decode(int(tok.eos_token_id), skip_special_tokens=False) if tok.eos_token_id is not None else None
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks"))
            decode = self.decode
            if kwargs.get("do_sample") and not self.explicit_decode:
                opts = {k: kwargs[k] for k in ("temperature", "top_k", "top_p") if kwargs.get(k) is not None}
                decode = component("decoders", {"kind": "sample", **opts})
            prompts = [self.example(requests[i].args[0]) for i in indices]
            decoded = generate(self.lm, prompts, steer=self.steer, decode=decode, max_new_tokens=max_new,
                               stop=until, batch_size=self.batch_size_, seed=self.seed, results=self.results,
                               ctx=self._step_ctx())
            for i, text in zip(indices, decoded.texts, strict=True):
                out[i] = postprocess_generated_text(text, until, None)
                self.cache_hook.add_partial("generate_until", tuple(requests[i].args), out[i])
        return out


def _max_length(lm: LoadedModel) -> int:
    cfg = lm.model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(cfg, attr, None)
        if value:
            return int(value)
    value = getattr(lm.tokenizer, "model_max_length", None)
    return int(value) if value and value < 10**9 else 2048


def _model_spec(model: Any, device: str | None, dtype: str | None) -> Any:
    """A model spec mapping from a name/path/mapping plus lm-eval's ``device``/``dtype`` arguments."""
    if model is None:

        model = ModelSpec().id
    spec: dict[str, Any] = dict(model) if isinstance(model, Mapping) else {"id": str(model)}
    if hasattr(model, "model_dump"):
        spec = model.model_dump()
    if device and not (device.startswith("cuda") and not _cuda()):  # lm-eval's CLI defaults to cuda
        spec["device"] = device
    if dtype:
        spec["dtype"] = dtype
    return spec


def _cuda() -> bool:

    return bool(torch.cuda.is_available())


def _from_spec(path: str, step: str | None, seed: int) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(model spec, decode, steer, results of the steps before the evaluate step) of a headlab spec."""

    loaded = load_spec(path)
    steps = loaded.spec.steps
    names = [s.id for s in steps]
    if step is not None and step not in names:
        raise ValueError(f"spec {path}: no step '{step}' (steps: {', '.join(names)})")
    index = names.index(step) if step is not None else next(
        (i for i, s in enumerate(steps) if s.action == "evaluate"), len(steps))
    decode = steer = None
    if index < len(steps):
        config = getattr(steps[index], steps[index].action)
        decode, steer = getattr(config, "decode", None), getattr(config, "steer", None)
    results: dict[str, Any] = {}
    if index > 0:
        data = dict(loaded.data)
        data["steps"] = list(data["steps"])[:index]
        data.pop("sweep", None)
        before = load_spec(data)
        results = run_cell(before, before.cells[0], ModelCache(before.spec.seed))
    return loaded.spec.model, decode, steer, results
