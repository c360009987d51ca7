"""The decoding demonstration on the embedded model, through specs/decoding_counterfact.yaml (slow: runs
the whole spec; skipped until the embedded checkpoint is present). Figures: docs/decoding.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import headlab

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny" / "config.json"


def context_rate(ds) -> float:
    """Fraction of examples answered with the context's answer (metric value 1)."""
    return float(np.mean(ds["context_memory"].values == 1.0))


@pytest.mark.slow
@pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
def test_decore_and_cad_raise_context_faithfulness(tmp_path):
    run = headlab.run(ROOT / "specs" / "decoding_counterfact.yaml", out=tmp_path)
    rate = {step: context_rate(run.results[step]) for step in ("greedy", "decore", "decore_random", "cad")}
    assert rate["decore"] > rate["greedy"], rate
    assert rate["cad"] > rate["greedy"], rate
    assert rate["decore"] > rate["decore_random"], rate
