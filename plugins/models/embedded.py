"""The embedded default model ``headlab-tiny``: a small Llama trained so retrieval and induction
heads really exist (see docs/model-card.md). It ships inside the package; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

from headlab import hookimpl
from headlab.model import LoadedModel, from_pretrained
from headlab.spec import ModelSpec

CHECKPOINT = Path(__file__).parent / "tiny" / "headlab-tiny"


def load(spec: ModelSpec) -> LoadedModel:
    """Load the embedded checkpoint with headlab's attention."""
    return from_pretrained(str(CHECKPOINT), spec, name="headlab-tiny")


@hookimpl
def headlab_register_models(register):
    if (CHECKPOINT / "config.json").is_file():
        register("headlab-tiny", load, "embedded 4-layer Llama (1.09M parameters) with real retrieval and induction heads")
