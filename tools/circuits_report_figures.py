"""The circuit figures of ``headlab report`` for ``specs/circuits.yaml``, exported as SVG for docs/circuits.md.

    python tools/circuits_report_figures.py [--run RUN] [--out docs/images]

Runs ``specs/circuits.yaml`` (about 25 s of CPU time; or reads the stored run ``--run``) and writes, with the
report's own figure code (:mod:`headlab.circuit_figures` on :mod:`headlab.figures`), ``circuits_report_*.svg``:
residual-stream patching per layer and token, the strongest heads' patching per token, AtP against exact
patching, direct logit attribution (heads, totals), the EAP-IG circuit, and the attention of the strongest DLA
head on example 0's prompt.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import headlab
from headlab import figures
from headlab.attention_patterns import head_patterns, run_model, top_heads
from headlab.circuit_figures import atp_scatter, circuit_chart, dla_chart, pattern_charts, token_chart
from headlab.circuit_view import atp_vs_exact, circuit_of, head_map, resid_map, token_labels, tokenizer_for

ROOT = Path(__file__).resolve().parent.parent
NOTE = "tokens of example 0; clean/corrupted where its prompts differ"


def charts(run: headlab.Run) -> dict[str, figures.Chart]:
    """The figures by file name."""
    res = run.results
    tokenizer = tokenizer_for(str(run.attrs["model"]), run.attrs.get("model_revision"))
    resid = resid_map(res["patch_resid"]["score"])
    tokens = token_labels(res["patch_resid"], tokenizer)
    pos = res["patch_pos"]["score"]
    strongest = top_heads(head_map(pos), 8)
    per_token = np.array([pos.sel(layer=a, head=b).values for a, b in strongest], dtype=float)
    heads, totals = dla_chart(res["dla"])
    lm = run_model(run.attrs)
    pattern = pattern_charts(head_patterns(lm, str(res["dla"]["prompt"].values[0]), top_heads(res["dla"]["score"], 1)),
                             title="attention of the strongest DLA head, ")[0]
    return {
        "circuits_report_resid.svg": token_chart(resid.values, [f"L{int(v)}" for v in resid["layer"].values], tokens,
                                                 title=["residual stream patching (patch_resid)", NOTE],
                                                 row_title="layer"),
        "circuits_report_tokens.svg": token_chart(per_token, [f"L{a}H{b}" for a, b in strongest], tokens,
                                                  title=["the strongest heads per token (patch_pos)", NOTE],
                                                  row_title="head"),
        "circuits_report_atp.svg": atp_scatter(atp_vs_exact(res["atp"], res["patch"], top_k=10, atp_step="atp",
                                                            exact_step="patch")),
        "circuits_report_dla_heads.svg": heads,
        "circuits_report_dla_totals.svg": totals,
        "circuits_report_circuit.svg": circuit_chart(circuit_of(res["eap"]), title="the EAP-IG circuit (eap)"),
        "circuits_report_attention.svg": pattern,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=None, help="a stored run of specs/circuits.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = headlab.open_run(args.run) if args.run else headlab.run(str(ROOT / "specs" / "circuits.yaml"), out=tmp)
        for name, chart in charts(run).items():
            print("wrote", figures.save(chart, args.out / name))


if __name__ == "__main__":
    main()
