"""Circuit analysis on the embedded model (slow: about 20 s of CPU time; skipped until the checkpoint is
present): exact patching of a key-swap pair task finds the heads the retrieval detector finds, and AtP's
agreement with exact patching. The spec and the measurements are tools/circuit_figures.py's, which prints
the numbers docs/circuits.md quotes ("Circuits of the embedded model") and draws its figures.

Measured (seed 0, 64 pairs): the retrieval heads (score >= 0.1 on a niah grid) are the last layer's L3H0,
L3H1, L3H3-L3H7. Patching one head at the last position only, the ten strongest heads hold all seven of
them, ranked 3-8 and 10, below L1H5 and L2H0, which move the queried key to the last position; patching a
head at every position, L3H1 and L3H0 (the retrieval detector's strongest) rank 3 and 5 and the top ten hold
four retrieval heads: heads of layer 0 then act at the key's own position too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import headlab

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny" / "config.json"


def figures_tool():
    spec = importlib.util.spec_from_file_location("circuit_figures", ROOT / "tools" / "circuit_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
def test_exact_patching_of_kv_swap_finds_the_retrieval_heads(tmp_path):
    tool = figures_tool()
    run = headlab.run(tool.SPEC, out=tmp_path)
    m = tool.measure(run)
    heads = set(m["retrieval_heads"])
    print(f"retrieval heads {sorted(heads)}; among the top 10 by patching at the last position: "
          f"{m['last_found']} (ranks {m['last_ranks']}), at every position: {m['every_found']} "
          f"(ranks {m['every_ranks']})")
    assert len(heads) >= 4
    assert m["last_found"] >= 5          # measured 7 of 7
    assert m["every_found"] >= 3         # measured 4 of 7
    every = [h for h, _ in m["every_top"]]
    top2 = [h for h, _ in m["retrieval_top"][:2]]
    assert all(h in every[:7] for h in top2)  # measured ranks 3 and 5
    for key in ("atp", "atp_pos", "atp_pos_tail"):
        print(f"{key}: Spearman with exact patching {m[key]['spearman']:.3f}, top-10 recall "
              f"{m[key]['top_k_recall']:.2f}")
    assert m["atp"]["top_k_recall"] >= 0.5       # measured 0.7
    assert m["atp_pos_tail"]["spearman"] >= 0.6  # measured 0.86
    # the direct logit attribution's terms add up to the logit difference, and its top heads are retrieval heads
    assert m["dla_heads_sum"] + m["dla_rest"] == pytest.approx(m["logit_diff"], abs=1e-3)
    assert {h for h, _ in m["dla_top"][:6]} <= heads  # measured: the top 7 are the 7 retrieval heads
