"""What the decoding actions (``generate``, ``score``, ``evaluate``) share: their common config fields,
steering, and the KV policy (``kv``) with the results it stores."""

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import xarray as xr
from pydantic import Field, model_validator

from headlab import component
from headlab.kv import HeadMap, KvPolicyError, KvUsage, kv_policy
from headlab.plugin import Batch, ContractError, Plan, PositiveInt, StrictModel
from headlab.scoring import steering_plan as core_steering_plan
from headlab.spec import SpecTypes


def kind_shorthand(value: Any) -> Any:
    """A bare string in a list of components is the kind: ``[exact_match]`` = ``[{kind: exact_match}]``."""
    return {"kind": value} if isinstance(value, str) else value


def decoding_config(types: SpecTypes) -> type[StrictModel]:
    """The base config of a decoding action: ``decode`` (a step without it uses the default decoder),
    ``steer`` (steering methods applied together), ``batch_size`` and ``kv``. A subclass that prefills prompts
    it generates from sets ``QUESTION_SPLIT`` (the ``kv`` policy's ``question_tokens``; refused otherwise)."""
    Decoder, Steer, Kv = types.union("decoders"), types.union("steering"), types.union("kv")
    default = types.default("decoders")
    about = "decoding strategy" + (f" (default: {default.kind_name()})" if default is not None else "")

    class Decoding(StrictModel):
        decode: Decoder = Field(description=about)
        steer: list[Steer] = Field(default_factory=list, description="steering methods applied together")
        batch_size: PositiveInt = Field(8, description="prompts (generate) or prompt+choice rows (score) per forward")
        kv: Kv | None = Field(None, description=KV_ABOUT)

        #: whether the step's prefills are prompts to generate from, which ``question_tokens`` splits
        QUESTION_SPLIT: ClassVar[bool] = False

        @model_validator(mode="before")
        @classmethod
        def default_decoder(cls, data: Any) -> Any:
            """A missing ``decode`` is the default decoder."""
            if default is not None and isinstance(data, Mapping) and data.get("decode") is None:
                data = {**data, "decode": {"kind": default.kind_name()}}
            return data

        @model_validator(mode="after")
        def _question_split(self) -> Any:
            if getattr(self.kv, "question_tokens", 0) and not self.QUESTION_SPLIT:
                raise ValueError("kv question_tokens splits a prompt to generate from into its context and its last "
                                 "tokens (kvpress's question); this step's forwards (scored prompt + choice rows, "
                                 "lm-eval requests) have no such split: give it on a generate step")
            return self

    return Decoding


def steering_plan(steer: list[Any], ctx: Any, batch: Batch) -> tuple[Plan | None, list[Callable[[], Any]]]:
    """The instrumentation plan of the steering methods ``steer`` for ``batch`` (None without any), and
    the reports they returned (called once the batch is generated): :func:`headlab.scoring.steering_plan`."""
    return core_steering_plan(steer, ctx, batch)


KV_ABOUT = ("KV-cache policy (default: none given, today's full cache, not measured): {kind: streaming, full_heads: "
            "{from: step, top: k}, sink: 4, window: 64}, ... (docs/kv.md)")


@dataclass
class KvRun:
    """A step's KV policy while it runs: its ``kind``, the compiled map (``requested``), the map in force (``head_map``:
    every head full when ``sink + window`` covers the step's context), the policy's ``prefill_chunk`` (None: a
    prompt in one forward), ``question_tokens`` (0: the whole prompt prefilled at once) and, once the step's
    forwards are done, what the caches held (``usage``)."""

    kind: str
    requested: HeadMap
    head_map: HeadMap
    length: int | None
    usage: KvUsage | None = None
    prefill_chunk: int | None = None
    measure_peak: bool = False
    question_tokens: int = 0


def compile_kv(config: Any, ctx: Any, length: int | None) -> KvRun | None:
    """The step's KV policy compiled through the ``kv`` component category, for a context of at most
    ``length`` tokens per row (None: unknown, the map applies as compiled); None when the step gives none."""
    if config is None:
        return None
    comp = component("kv", config.kind)
    head_map = comp.impl(config, ctx)
    if not isinstance(head_map, HeadMap):
        raise ContractError(f"the KV policy returned {type(head_map).__name__}, not a headlab.kv.HeadMap",
                            category="kv", kind=config.kind)
    geometry = ctx.model.geometry
    if (head_map.n_layers, head_map.n_kv_heads) != (geometry.n_layers, geometry.n_kv_heads):
        raise KvPolicyError(f"kv '{config.kind}': a head map of {head_map.n_layers} layers x {head_map.n_kv_heads} KV "
                            f"heads, this model has {geometry.n_layers} x {geometry.n_kv_heads}")
    if length is None and head_map.pending:
        raise KvPolicyError(f"kv '{config.kind}': a budget is met at a context length, which this step does not know "
                            "before it runs; give the budget's `length` (budget: {fraction: ..., length: N})")
    effective = head_map if length is None else head_map.for_length(length)
    return KvRun(config.kind, head_map, effective, length, prefill_chunk=getattr(config, "prefill_chunk", None),
                 measure_peak=bool(getattr(config, "measure_peak", False)),
                 question_tokens=int(getattr(config, "question_tokens", 0)))


@contextlib.contextmanager
def kv_running(run: KvRun | None, ctx: Any) -> Iterator[None]:
    """Every forward of the step's model inside the block under the policy (nothing without one), its prompts
    prefilled by ``prefill_chunk`` tokens when the policy gives it (their last ``question_tokens`` fed after the
    prefill's compression), the peak memory measured (on a CPU with ``measure_peak``)."""
    if run is None:
        yield
        return
    with kv_policy(ctx.model.model, run.head_map, prefill_chunk=run.prefill_chunk,
                   question_tokens=run.question_tokens, cpu_peak=run.measure_peak) as usage:
        run.usage = usage
        yield


def kv_results(ds: xr.Dataset, run: KvRun | None) -> xr.Dataset:
    """``ds`` with what a step with a KV policy stores: ``kv_bytes(layer)`` (bytes held at the end of each
    cache, summed over the step's batches and rows), ``kv_full(layer, kv_head)`` (the map in force, with its
    attributes; ``question_tokens`` among them when the policy split its prompts), the 0-d ``kv_kept_fraction`` (one per sweep cell once cells are combined) and the attrs
    ``kv_policy``, ``kv_bytes_full``, ``kv_kept_fraction``, ``kv_attention`` (the path that read the caches),
    ``kv_effective``/``kv_note`` when the window covers the context, ``kv_peak_memory`` (bytes) with
    ``kv_peak_memory_measure`` (what was measured: :class:`headlab.kv.KvUsage`)."""
    if run is None or run.usage is None:
        return ds
    usage, head_map = run.usage, run.head_map
    kept = usage.kept_fraction()
    ds = ds.assign(kv_bytes=usage.to_dataarray(), kv_full=head_map.to_dataarray(run.length),
                   kv_kept_fraction=((), kept))
    if run.question_tokens and not head_map.is_full:
        ds["kv_full"].attrs["question_tokens"] = run.question_tokens
    paths = sorted(usage.paths) if not head_map.is_full else ["the model's own cache (every KV head full)"]
    ds.attrs.update(kv_policy=run.kind, kv_bytes_full=usage.full_nbytes,
                    kv_kept_fraction=kept, kv_attention=" | ".join(paths))
    if head_map.attrs.get("effective") == "full" and not run.requested.is_full:
        ds.attrs.update(kv_effective="full", kv_note=str(head_map.attrs.get("note", "")))
    if usage.peak_memory is not None:
        ds.attrs.update(kv_peak_memory=usage.peak_memory, kv_peak_memory_measure=usage.peak_memory_measure)
    return ds
