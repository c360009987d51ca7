"""The resource guard: before a cell runs, estimate the largest allocations it needs and refuse past a budget.

A huge ``n``, ``length``, ``max_new_tokens`` or context length must fail in a second with the estimate in
the message, never hang or die in the allocator. Estimates come from the configs themselves, before
anything is built:

- a task config may define ``size(self) -> TaskSize | None``: how many examples it builds and an upper
  bound of one example's length in tokens (None: unknown, e.g. a data file; the steps are then estimated
  for one one-token example, a lower bound that still catches a huge ``max_new_tokens``);
- any config of a step (the action's, a detector, a decoder, a steering method) may define
  ``estimate(self, ctx: EstimateContext) -> Iterable[Estimate]``: its largest tensors, from the model's
  geometry and the task's size (:meth:`EstimateContext.kv_cache`, :meth:`~EstimateContext.attention` and
  :meth:`~EstimateContext.activations` compute the usual ones).

The core adds the examples themselves (``examples x (1 KiB + 64 B x tokens)`` of host memory) and, for a
model built from ``model.config``, its parameters (counted on the meta device, nothing allocated). Each
estimate is compared with the budget on its own: the guard catches sizes that cannot fit, it does not
account for every byte.

The budget, first found wins: ``headlab run --memory-limit``, the environment variable
``HEADLAB_MEMORY_LIMIT`` (``none`` turns the guard off), the spec's ``limits: {memory: 8GiB}``, else 80% of
the machine's memory (of the GPU's for estimates that live on a CUDA device). ``limits: {guard: false}``
turns the guard off for a spec.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel

from .model import resolve_device
from .spec import parse_size

__all__ = ["Budget", "Estimate", "EstimateContext", "ResourceLimitError", "TaskSize", "budget", "check",
           "estimates", "format_bytes"]

ENV = "HEADLAB_MEMORY_LIMIT"
"""Environment variable holding the memory budget (bytes or e.g. ``8GiB``; ``none`` disables the guard)."""
DEFAULT_FRACTION = 0.8
"""Share of the machine's (or GPU's) memory the default budget allows one estimate."""
EXAMPLE_OVERHEAD = 1024
"""Host bytes an example costs besides its tokens (Python objects, its prompt's characters)."""
BYTES_PER_TOKEN = 64
"""Host bytes per token of an example (its id in a list, its characters, the stored ``input_ids``)."""


class ResourceLimitError(ValueError):
    """A cell would need more memory than the budget; the message gives the estimate and how to change the
    budget. Raised before anything is allocated."""


@dataclass(frozen=True)
class TaskSize:
    """How big a task's examples are: how many, and at most how many tokens one prompt has."""

    examples: int
    tokens: int


@dataclass(frozen=True)
class Estimate:
    """One allocation a step needs: what it is, its size in bytes, how it was computed, where it lives
    (``"device"``: the model's device; ``"host"``: main memory)."""

    what: str
    bytes: int
    detail: str = ""
    where: str = "device"


@dataclass
class EstimateContext:
    """What a config's ``estimate`` receives: the model's geometry and sizes, and the task's size."""

    geometry: Any
    dtype_bytes: int
    hidden_size: int
    vocab_size: int
    task: TaskSize
    step_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def rows(self, batch_size: int) -> int:
        """Rows of one forward: ``batch_size``, or fewer when the task has fewer examples."""
        return max(1, min(int(batch_size), self.task.examples))

    def kv_cache(self, tokens: int, rows: int, what: str = "KV cache") -> Estimate:
        """``layers x 2 x kv_heads x head_dim x tokens x rows x dtype bytes``."""
        g = self.geometry
        size = g.n_layers * 2 * g.n_kv_heads * g.head_dim * int(tokens) * int(rows) * self.dtype_bytes
        return Estimate(what, size, f"{g.n_layers} layers x 2 x {g.n_kv_heads} kv heads x {g.head_dim} dims x "
                        f"{int(tokens):,} tokens x {int(rows):,} rows x {self.dtype_bytes} bytes")

    def attention(self, queries: int, keys: int, rows: int, what: str = "attention pattern") -> Estimate:
        """Full attention patterns of every head: ``rows x layers x heads x queries x keys x 4 bytes``."""
        g = self.geometry
        size = int(rows) * g.n_layers * g.n_heads * int(queries) * int(keys) * 4
        return Estimate(what, size, f"{int(rows):,} rows x {g.n_layers} layers x {g.n_heads} heads x "
                        f"{int(queries):,} queries x {int(keys):,} keys x 4 bytes")

    def activations(self, tokens: int, rows: int, what: str = "hidden states of a forward") -> Estimate:
        """``rows x tokens x hidden x dtype bytes`` (one layer's hidden states; a forward holds a few)."""
        size = int(rows) * int(tokens) * self.hidden_size * self.dtype_bytes
        return Estimate(what, size, f"{int(rows):,} rows x {int(tokens):,} tokens x {self.hidden_size} hidden x "
                        f"{self.dtype_bytes} bytes")


def format_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} EiB"


def machine_memory() -> int:
    """Total physical memory of this machine in bytes (0 when it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        try:
            import psutil

            return int(psutil.virtual_memory().total)
        except Exception:  # noqa: BLE001 - no way to read it: the default budget is then unlimited
            return 0


def device_memory(device: str) -> int:
    """Total memory of a CUDA device in bytes; the machine's memory for any other device."""
    if str(device).startswith("cuda"):

        try:
            return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
        except Exception:  # noqa: BLE001 - fall back to the host's memory
            pass
    return machine_memory()


@dataclass(frozen=True)
class Budget:
    """The largest estimate allowed on the host and on the model's device, and where the limit came from."""

    host: int | None
    device: int | None
    source: str

    def limit(self, where: str) -> int | None:
        return self.device if where == "device" else self.host


def budget(limits: Any = None, device: str = "cpu") -> Budget:
    """The budget in force (see the module docs for the order): ``limits`` is the spec's ``limits``."""
    env = os.environ.get(ENV, "").strip()
    if env:
        if env.lower() in ("none", "off", "0", "false"):
            return Budget(None, None, f"{ENV}={env}")
        try:
            size = parse_size(env)
        except ValueError as e:
            raise ResourceLimitError(f"{ENV}: {e}") from None
        return Budget(size, size, f"{ENV} (or --memory-limit)")
    if limits is not None and not getattr(limits, "guard", True):
        return Budget(None, None, "limits.guard: false")
    if limits is not None and getattr(limits, "memory", None):
        return Budget(limits.memory, limits.memory, "the spec's limits.memory")
    host, dev = machine_memory(), device_memory(device)
    return Budget(int(host * DEFAULT_FRACTION) or None, int(dev * DEFAULT_FRACTION) or None,
                  f"{DEFAULT_FRACTION:.0%} of this machine's memory" + (" (GPU)" if str(device).startswith("cuda") else ""))


def configs_in(node: Any, seen: set[int] | None = None) -> Iterator[BaseModel]:
    """Every pydantic config inside ``node`` (itself first), depth first."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, BaseModel):
        yield node
        for name in type(node).model_fields:
            yield from configs_in(getattr(node, name, None), seen)
    elif isinstance(node, (list, tuple)):
        for item in node:
            yield from configs_in(item, seen)
    elif isinstance(node, dict):
        for item in node.values():
            yield from configs_in(item, seen)


def task_size(task: Any) -> TaskSize | None:
    """The task config's ``size()``, or None when it does not say."""
    size = getattr(task, "size", None)
    if not callable(size):
        return None
    return size()


class EstimateFailed(Exception):
    """A component's ``size()`` or ``estimate()`` raised: ``step`` (the spec's step), ``config`` (the config whose
    method raised), ``task`` (whether it is the step's task) and the exception (``cause``, also ``__cause__``)."""

    def __init__(self, cause: BaseException, step: Any, config: Any, task: bool = False) -> None:
        self.cause, self.step, self.config, self.task = cause, step, config, task
        super().__init__(str(cause))


def estimates(spec: Any, lm: Any) -> Iterator[tuple[str, Estimate]]:
    """``(step id, estimate)`` for every step of one cell's spec (``""`` for the model itself). A component's
    ``size()`` or ``estimate()`` that raises is an :class:`EstimateFailed` naming the step and the config."""

    dtype_bytes = torch.tensor([], dtype=lm.model.dtype).element_size() if hasattr(lm.model, "dtype") else 4
    text = lm.model.config.get_text_config() if hasattr(lm.model.config, "get_text_config") else lm.model.config
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or 0)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    for step in spec.steps:
        task = step.task or spec.task
        try:
            size = task_size(task)
        except Exception as e:
            raise EstimateFailed(e, step, task, task=True) from e
        if size is not None:
            yield step.id, Estimate(f"examples of task '{task.kind}'",
                                    size.examples * (EXAMPLE_OVERHEAD + BYTES_PER_TOKEN * size.tokens),
                                    f"{size.examples:,} examples x (1 KiB + {size.tokens:,} tokens x 64 bytes)", "host")
        else:  # a task that cannot say (a data file): the step's estimates for one one-token example, a lower bound
            size = TaskSize(1, 1)
        ctx = EstimateContext(lm.geometry, dtype_bytes, hidden, vocab, size, step.id)
        for config in configs_in(getattr(step, step.action)):
            estimate = getattr(config, "estimate", None)
            if callable(estimate):
                try:
                    items = list(estimate(ctx) or ())
                except Exception as e:
                    raise EstimateFailed(e, step, config) from e
                for item in items:
                    yield step.id, item


def check(spec: Any, lm: Any, where: str = "") -> list[tuple[str, Estimate]]:
    """Refuse (:class:`ResourceLimitError`) a cell whose largest estimate is over the budget; returns the
    estimates. ``where`` names the cell in the message."""
    limit = budget(getattr(spec, "limits", None), getattr(lm, "device", "cpu"))
    found = list(estimates(spec, lm))
    if limit.host is None and limit.device is None:
        return found
    for step, est in sorted(found, key=lambda se: -se[1].bytes):
        allowed = limit.limit(est.where)
        if allowed is not None and est.bytes > allowed:
            place = f"{where}, " if where else ""
            owner = f"step '{step}'" if step else "the model"
            raise ResourceLimitError(
                f"{place}{owner}: {est.what} would take an estimated {format_bytes(est.bytes)} ({est.detail}), over "
                f"the budget of {format_bytes(allowed)} ({limit.source}); make the task or batch smaller, or raise "
                f"the budget (limits.memory in the spec, {ENV} or --memory-limit)")
    return found


def check_model(model_spec: Any, limits: Any = None) -> Estimate | None:
    """Refuse a ``model.config`` model whose parameters alone exceed the budget, before building it (the
    model is built on the meta device to count them). Other models load from files already on disk."""
    if getattr(model_spec, "config", None) is None:
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in model_spec.config.items() if k not in ("model_type", "tokenizer")}
    try:
        config = AutoConfig.for_model(model_spec.config.get("model_type"), **cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - an invalid config is reported by the loader itself
        return None
    params = sum(p.numel() for p in model.parameters())
    width = {"bfloat16": 2, "float16": 2}.get(model_spec.dtype, 4)
    est = Estimate("parameters of model.config", params * width, f"{params:,} parameters x {width} bytes")

    try:
        device = resolve_device(model_spec.device)
    except Exception:  # noqa: BLE001 - the loader reports a bad device
        return est
    limit = budget(limits, device)
    if limit.device is not None and est.bytes > limit.device:
        raise ResourceLimitError(
            f"model: {est.what} would take an estimated {format_bytes(est.bytes)} ({est.detail}), over the budget of "
            f"{format_bytes(limit.device)} ({limit.source}); make the model smaller, or raise the budget "
            f"(limits.memory in the spec, {ENV} or --memory-limit)")
    return est

