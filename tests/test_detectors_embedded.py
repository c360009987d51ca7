"""The retrieval-head paper's findings on the embedded model, through specs/retrieval_heads.yaml (slow: runs
the whole spec; skipped until the embedded checkpoint is present)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import headlab

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "plugins" / "models" / "tiny" / "headlab-tiny" / "config.json"


@pytest.mark.slow
@pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
def test_retrieval_heads_spec_reproduces_the_paper(tmp_path):
    run = headlab.run(ROOT / "specs" / "retrieval_heads.yaml", out=tmp_path)
    ret, abl = run.results["retrieval"], run.results["ablation"]
    is_head = ret["retrieval_head"].values
    assert 0 < is_head.sum() <= 0.25 * is_head.size, "retrieval heads are a small fraction of all heads"
    assert float(abl["base"]) >= 0.9, "the unmasked model retrieves the needle"
    assert float(abl["top"].max()) <= 0.2, "masking the retrieval heads collapses recall"
    assert np.min(abl["random"].values) >= 0.8, "masking as many random heads keeps recall"
