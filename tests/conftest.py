"""Shared fixtures: tiny random models built from configs (nothing is downloaded)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run under the interpreter on CPU; it is read when kernels are decorated, so it must be set
# before any test module imports triton. HEADLAB_TRITON_CUDA=1 keeps compiled kernels on a GPU machine.
if os.environ.get("HEADLAB_TRITON_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 97, "max_position_embeddings": 256}


@pytest.fixture
def tiny_llama() -> dict:
    """A config mapping for a 2-layer, 4-head (2 kv heads) Llama with random weights."""
    return dict(TINY_LLAMA)


def spec_text(steps: str, *, sweep: str = "", task: str = "{kind: repeated_tokens, n: 4, length: 8}",
              model: dict | None = None, out: str = "") -> str:
    """A spec YAML string on the tiny random Llama."""
    import json

    text = (f"name: test\nmodel: {{config: {json.dumps(model or TINY_LLAMA)}}}\ntask: {task}\n"
            f"steps:\n{steps}")
    if sweep:
        text += f"sweep:\n{sweep}"
    if out:
        text += f"output: {out}\n"
    return text


def spec_error(text: str) -> str:
    """The message of the ``SpecError`` that loading the spec ``text`` raises (asserted to be one line)."""
    import headlab
    from headlab.spec import SpecError

    with pytest.raises(SpecError) as info:
        headlab.load_spec(text)
    assert "\n" not in str(info.value)
    return str(info.value)
