"""The embedded models: ``headlab-tiny``, a small Llama trained so retrieval and induction heads really
exist, and ``headlab-tiny-vlm``, a tiny LLaVA on its language model trained on the ``shapes`` task so
that its answers depend on the image (see docs/model-card.md). They ship inside the package; nothing is
downloaded. ``headlab-tiny`` is the default model: the one a spec that names no model loads."""

from __future__ import annotations

from pathlib import Path

from headlab import from_pretrained
from headlab.plugin import LoadedModel, ModelSpec, hookimpl

CHECKPOINT = Path(__file__).parent / "tiny" / "headlab-tiny"
VLM_CHECKPOINT = Path(__file__).parent / "tiny" / "headlab-tiny-vlm"


def load(spec: ModelSpec) -> LoadedModel:
    """Load the embedded checkpoint with headlab's attention."""
    return from_pretrained(str(CHECKPOINT), spec, name="headlab-tiny")


def load_vlm(spec: ModelSpec) -> LoadedModel:
    """Load the embedded vision-language checkpoint (model, tokenizer and processor) with headlab's attention."""
    return from_pretrained(str(VLM_CHECKPOINT), spec, name="headlab-tiny-vlm")


@hookimpl
def headlab_register_models(register):
    if (CHECKPOINT / "config.json").is_file():
        register("headlab-tiny", load, "embedded 4-layer Llama (1.09M parameters) with real retrieval and induction heads",
                 default=True)
    if (VLM_CHECKPOINT / "config.json").is_file():
        register("headlab-tiny-vlm", load_vlm, "embedded tiny LLaVA (1.59M parameters; 96x96 images, 64 image "
                 "tokens) on headlab-tiny, trained on the shapes task")
