"""Greedy outputs of a task's examples with chosen heads masked, batched by prompt length: the causal check's
machinery (masking heads and reading what the model then generates), shared by the detectors and actions that
ablate heads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from headlab.example import Example
from headlab.generation import DecodeRequest, PromptSplit, decode_loop, tokenize
from headlab.instrument import Plan
from headlab.model import LoadedModel
from headlab.plugin_manager import PluginError, component

__all__ = ["ablate", "length_batches", "metric_config"]

Head = tuple[int, int]


def length_batches(lengths: Sequence[int], batch_size: int, slack: float = 0.125) -> list[list[int]]:
    """Indices grouped into batches of at most ``batch_size`` by length: sorted by length, a batch is closed
    when full or when the next item is more than ``slack`` (fraction) longer than the batch's first, so
    left padding stays small (a padded prefill costs as much as its longest row)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        if out and len(out[-1]) < batch_size and lengths[i] <= (1 + slack) * lengths[out[-1][0]]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def metric_config(metric: str | dict[str, Any]) -> Any:
    """The validated config model of a metric given as a kind or ``{kind, ...options}``."""
    data = {"kind": metric} if isinstance(metric, str) else dict(metric)
    try:
        comp = component("metrics", str(data.get("kind")))
    except PluginError as e:
        raise ValueError(f"metric: {e}") from None
    return comp.config.model_validate(data)


def ablate(lm: LoadedModel, examples: list[Example], conditions: list[list[Head]], *, mode: str = "query",
           max_new_tokens: int = 16, stop: list[str] | None = None, batch_size: int = 32,
           mask_prompt: bool = True, length_slack: float = 0.125, progress: Any = None) -> list[list[str]]:
    """Greedy outputs of every example under every condition (a list of heads to mask; [] = none).

    Returns ``outputs[condition][example]``. Rows are (example, condition) pairs with per-row masks; a batch
    holds every condition of ``max(1, batch_size // len(conditions))`` examples of similar length. ``mask_prompt=False``
    prefills the prompt minus its last token unmasked and masks from the last prompt token on (DeCoRe's
    reference masked branch), so the masks act on the queries that produce the answer only.
    """
    lengths = [len(ex.input_ids) if ex.input_ids is not None else len(lm.tokenizer(ex.prompt)["input_ids"])
               for ex in examples]
    per_batch = max(1, batch_size // len(conditions))  # examples per batch, all their conditions together
    chunks = [[(i, c) for i in group for c in range(len(conditions))]
              for group in length_batches(lengths, per_batch, length_slack)]
    outputs = [[""] * len(examples) for _ in conditions]
    it = progress(chunks, "ablation") if progress is not None else chunks
    for chunk in it:
        batch = tokenize(lm, [examples[i] for i, _ in chunk])
        plan = Plan()

        def add_masks(plan: Plan = plan, chunk: list = chunk) -> None:
            for r, (_, c) in enumerate(chunk):
                if conditions[c]:
                    plan.mask_heads(conditions[c], rows=[r], mode=mode)

        greedy = lambda out, _: out.logits[:, -1].argmax(-1)  # noqa: E731
        if mask_prompt:
            add_masks()
            request = DecodeRequest(lm, batch, max_new_tokens, list(stop or []), None if plan.is_empty() else plan)
            texts = decode_loop(request, greedy).texts
        else:
            request = DecodeRequest(lm, batch, max_new_tokens, list(stop or []), plan)
            texts = decode_loop(request, greedy, split=PromptSplit(then=add_masks)).texts
        for (i, c), text in zip(chunk, texts, strict=True):
            outputs[c][i] = text
    return outputs
