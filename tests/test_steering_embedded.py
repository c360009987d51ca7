"""PASTA on the embedded model's emphasis task, through specs/pasta_emphasis.yaml (slow: runs the whole
spec; skipped until the embedded checkpoint is present). The figures are in docs/steering.md."""

from __future__ import annotations

from pathlib import Path

import pytest

import headlab

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny" / "config.json"


@pytest.mark.slow
@pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
def test_pasta_moves_emphasis_accuracy(tmp_path):
    run = headlab.run(ROOT / "specs" / "pasta_emphasis.yaml", out=tmp_path)
    acc = {k: float(run.results[k]["any_answer"].mean()) for k in
           ("baseline", "plain_text", "markers", "pasta", "pasta_random")}
    assert acc["pasta"] >= acc["baseline"] + 0.2, acc
    assert acc["pasta"] >= acc["plain_text"] + 0.2, acc
    assert acc["pasta"] >= acc["markers"] + 0.2, acc
    assert acc["pasta"] > acc["pasta_random"], acc  # the profiled heads, not any heads (docs/steering.md)
    prof = run.results["profile"]
    assert 0 < int(prof["selected"].sum()) < prof["selected"].size
