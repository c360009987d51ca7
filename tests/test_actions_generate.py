"""The ``generate`` action's stored arrays: ``output_ids`` next to ``output``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import headlab
from headlab.generation import DecodeRequest, tokenize
from headlab.model import load_model
from headlab.plugin_manager import get_manager
from headlab.runner import build_examples
from headlab.spec import ModelSpec

CHECKPOINT = Path(__file__).parent.parent / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny" / "model.safetensors"
TASK = {"kind": "counterfact", "n": 3}


@pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
def test_output_ids_are_the_generated_tokens(tmp_path):
    spec = {"name": "ids", "model": "headlab-tiny", "task": TASK,
            "steps": [{"id": "gen", "generate": {"max_new_tokens": 12, "batch_size": 2}}]}
    ds = headlab.run(spec, out=tmp_path).results["gen"]
    assert ds["output_ids"].dims == ("example", "step")
    lm = load_model(ModelSpec(id="headlab-tiny", device="cpu"))
    examples = build_examples(headlab.load_spec(spec).spec.task, lm, seed=0)
    decoded = get_manager().get("decoders", "greedy").impl(
        get_manager().get("decoders", "greedy").config(), DecodeRequest(lm, tokenize(lm, examples), 12))
    ids = ds["output_ids"].values
    for r, toks in enumerate(decoded.tokens):
        assert ids[r, : len(toks)].tolist() == toks
        assert (ids[r, len(toks):] == -1).all()
        assert lm.tokenizer.decode(toks, skip_special_tokens=True) == ds["output"].values[r]
    assert ids.shape[1] == max(len(t) for t in decoded.tokens)  # greedy stores no per-step diagnostics
    assert np.issubdtype(ids.dtype, np.integer)
