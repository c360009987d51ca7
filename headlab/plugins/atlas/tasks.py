"""The atlas's detectors: each one's built-in task, its detect config, the variable it reads, its default threshold
and where that threshold comes from (docs/atlas.md).

Every task is generated from the model's own tokenizer and vocabulary by a built-in task kind, so nothing is
downloaded: random tokens repeated twice (``repeated_tokens``) for the pattern roles and sinks, a needle in a
haystack (``niah``) for retrieval, key-value prompts (``kv_retrieval``) for gradient importance and Ships, and
images of shapes (``shapes``) for the image-divergence of a vision-language model. Weight-level detectors
(successor, copy suppression, copying, composition) read no examples; their recorded task is the pattern task,
which a ``detect`` step needs but they do not use.

``ATLAS_DETECTORS`` is the catalogue, in the cube's order; :func:`detector_step` gives the spec step (task and
detect config) behind each entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ATLAS_DETECTORS", "AtlasDetector", "SHARED_PATTERN", "detector_step", "not_applicable"]


@dataclass(frozen=True)
class AtlasDetector:
    """One slice of the atlas: ``name`` (the cube's ``detector`` coordinate), the detect config ``detect``
    (kind and options), the result ``variable`` its score is read from, the ``task`` it runs on
    (``pattern``, ``needle``, ``kv``, ``images`` or ``weights``), its ``default`` threshold and that threshold's
    ``source``; ``importance`` marks the detectors that run only when asked (``importance: true``)."""

    name: str
    detect: dict[str, Any]
    variable: str
    task: str
    default: float | None
    source: str
    importance: bool = False


_HALF = "headlab: half the ceiling of the mul score on a segment repeated twice (0.5)"

#: the detectors of the atlas, in the cube's order
ATLAS_DETECTORS: dict[str, AtlasDetector] = {d.name: d for d in (
    AtlasDetector("previous_token", {"kind": "previous_token"}, "score", "pattern", 0.5,
                  "headlab: half of the attention on the previous token"),
    AtlasDetector("duplicate_token", {"kind": "duplicate_token", "exclude_bos": True}, "score", "pattern", 0.25,
                  _HALF),
    AtlasDetector("induction", {"kind": "induction", "exclude_bos": True}, "score", "pattern", 0.25, _HALF),
    AtlasDetector("attention_sink", {"kind": "attention_sink"}, "score", "pattern", 0.3, "Gu et al. 2024"),
    AtlasDetector("retrieval", {"kind": "retrieval", "max_new_tokens": 16}, "score", "needle", 0.1,
                  "Wu et al. 2024"),
    AtlasDetector("successor", {"kind": "successor"}, "score", "weights", 0.5,
                  "headlab: the successor is the top of the OV row for half the ordinal items"),
    AtlasDetector("copy_suppression", {"kind": "copy_suppression", "copying": "eigen"}, "score", "weights", 0.5,
                  "headlab: half the sampled tokens in the bottom-10 of their own OV row"),
    AtlasDetector("copying", {"kind": "copy_suppression", "copying": "eigen"}, "copying", "weights", 0.7,
                  "headlab: a mostly positive eigenvalue spectrum (none published for the score of Elhage et al. 2021)"),
    AtlasDetector("composition", {"kind": "composition"}, "score", "weights", None,
                  "random matrices of the heads' shapes: baseline mean + 3 std (Elhage et al. 2021)"),
    AtlasDetector("segment_divergence", {"kind": "segment_divergence"}, "score", "images", None,
                  "none published (VHR selects per layer by the median): the null alone"),
    AtlasDetector("head_importance", {"kind": "head_importance"}, "score", "kv", None,
                  "none published (Michel et al. 2019 rank heads): the null alone", importance=True),
    AtlasDetector("ships", {"kind": "ships"}, "score", "kv", None,
                  "none published (Zhou et al. 2025 rank heads): the null alone", importance=True),
)}

#: the detectors read from one shared probe forward over the pattern task
SHARED_PATTERN = ("previous_token", "duplicate_token", "induction", "attention_sink")


def _task(task: str, tokens: int, n: int) -> dict[str, Any]:
    if task in ("pattern", "weights"):
        return {"kind": "repeated_tokens", "n": n, "length": max(2, tokens // 2)}
    if task == "needle":
        return {"kind": "niah", "context_lengths": [tokens], "n": n}
    if task == "kv":
        return {"kind": "kv_retrieval", "n": n, "num_pairs": [8]}
    if task == "images":
        return {"kind": "shapes", "n": n, "question": "caption"}
    raise ValueError(f"unknown atlas task {task!r}")


def detector_step(name: str, tokens: int, n: int) -> dict[str, Any]:
    """``{"task": ..., "detect": ..., "variable": ...}``: the spec step whose ``variable`` is detector ``name``'s
    slice of the atlas, for tasks of about ``tokens`` tokens and ``n`` examples."""
    d = ATLAS_DETECTORS[name]
    return {"task": _task(d.task, tokens, n), "detect": dict(d.detect), "variable": d.variable}


def not_applicable(name: str, lm: Any) -> str | None:
    """Why detector ``name`` cannot run on the loaded model ``lm`` (None when it can), from what the model has;
    a task that cannot be built from its tokenizer (no ordinal tokens for successor heads) is found when the
    detector runs, and skipped then."""
    d = ATLAS_DETECTORS[name]
    if d.task == "images" and not lm.is_vision:
        return "the model reads no images (segment divergence compares a forward with and without the image)"
    if d.task in ("needle", "kv") and lm.tokenizer is None:
        return f"the model has no tokenizer to write its {d.task} task's text"
    if name == "successor" and lm.tokenizer is None:
        return "the model has no tokenizer to map ordinal sequences to tokens"
    return None
