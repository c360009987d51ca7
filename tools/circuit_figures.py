"""Figures and numbers of the circuit detectors on the embedded model (docs/circuits.md, "Circuits of the
embedded model").

    python tools/circuit_figures.py [--out docs/images] [--runs DIR]

Runs :data:`SPEC` (64 ``kv_swap`` pairs: exact activation patching over every position and per position,
AtP of both compared with them, direct logit attribution, attention sinks; the retrieval detector on a niah
grid), writes the SVG figures ``circuits_*.svg`` into ``--out`` with headlab's own figure code (the
report's), and prints the numbers the docs quote. ``tests/test_circuits_embedded.py`` (slow) runs the same
spec and asserts bounds on them.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import xarray as xr

import headlab
from headlab.circuit_figures import circuit_chart, dla_chart, token_chart
from headlab.circuit_view import circuit_edges
from headlab.figures import combine, heatmap, to_svg
from headlab.heads import ranked
from headlab.plugins.detectors.attribution_patching import spearman, top_k_recall

SPEC = """
name: circuits-embedded
model: headlab-tiny
seed: 0
task: {kind: kv_swap, n: 64, num_pairs: 6}
steps:
  - id: patch
    detect: {kind: activation_patching, metric: logit_diff, unit: z}
  - id: patch_pos
    detect: {kind: activation_patching, metric: logit_diff, unit: z_position}
  - id: atp
    detect: {kind: attribution_patching, metric: logit_diff, unit: z, reference: patch}
  - id: atp_pos
    detect: {kind: attribution_patching, metric: logit_diff, unit: z_position, reference: patch_pos}
  - id: dla
    detect: {kind: direct_logit_attribution}
  - id: sinks
    detect: {kind: attention_sink}
  - id: retrieval
    task: {kind: niah, context_lengths: [128, 256], depths: 3, needles: 2}
    detect: {kind: retrieval, max_new_tokens: 12}
"""


def _label(head: tuple[int, int]) -> str:
    return f"L{head[0]}H{head[1]}"


def measure(run: headlab.Run) -> dict:
    """The numbers the docs quote, from a run of :data:`SPEC`."""
    res = run.results
    retrieval = ranked(res["retrieval"]["score"])
    heads = {h for h, s in retrieval if s >= 0.1}
    every = ranked(res["patch"]["score"])
    last = ranked(res["patch_pos"]["score"].isel(token=-1))
    # the per-position units where the prompts differ (the key and the last token): the units before the key
    # are exact zeros in both, ties that would inflate the correlation
    tail = dict(token=slice(-2, None))
    exact_tail, atp_tail = res["patch_pos"]["score"].isel(tail).values, res["atp_pos"]["score"].isel(tail).values
    return {
        "pairs": res["patch"].sizes["example"],
        "clean": float(res["patch"]["clean"].mean()), "corrupt": float(res["patch"]["corrupt"].mean()),
        "retrieval_heads": sorted(heads), "retrieval_top": [(h, s) for h, s in retrieval[:8]],
        "every_top": every[:10], "last_top": last[:10],
        "every_found": len({h for h, _ in every[:10]} & heads), "last_found": len({h for h, _ in last[:10]} & heads),
        "every_ranks": sorted([h for h, _ in every].index(h) + 1 for h in heads),
        "last_ranks": sorted([h for h, _ in last].index(h) + 1 for h in heads),
        "atp": {k: res["atp"].attrs[k] for k in ("spearman", "top_k_recall")},
        "atp_pos": {k: res["atp_pos"].attrs[k] for k in ("spearman", "top_k_recall")},
        "atp_pos_tail": {"spearman": spearman(exact_tail, atp_tail),
                         "top_k_recall": top_k_recall(np.abs(exact_tail), np.abs(atp_tail), 10)},
        "dla_top": ranked(res["dla"]["score"])[:8], "dla_rest": float(res["dla"]["rest"].mean()),
        "logit_diff": float(res["dla"]["logit_diff"].mean()),
        "dla_heads_sum": float(res["dla"]["score"].sum()),
        "sink_rate": res["sinks"].attrs["sink_rate"], "sinks_top": ranked(res["sinks"]["score"])[:4],
        "massive_ratio": [float(v) for v in res["sinks"]["massive_ratio"].values],
    }


def figures(run: headlab.Run, tokens: list[str]) -> dict[str, str]:
    """The SVG figures by file name."""
    res = run.results
    retrieval = [h for h, s in ranked(res["retrieval"]["score"]) if s >= 0.1]
    pos = res["patch_pos"]["score"]
    strongest = [h for h, _ in ranked(abs(pos.isel(token=-1)))[:8]]
    dla = res["dla"]
    names = [f"a{layer}.h{head}" for layer in dla["layer"].values for head in dla["head"].values]
    direct = xr.DataArray(dla["score"].values.reshape(-1), dims="edge",
                          coords={"source": ("edge", names), "destination": ("edge", ["logits"] * len(names))})
    per_token = pos.transpose("layer", "head", "token")
    per_token_values = np.array([per_token.sel(layer=a, head=b).values for a, b in strongest], dtype=float)

    def heatmap_svg(values, **kw):
        return to_svg(heatmap(values, **kw))

    return {
        "circuits_patching.svg": heatmap_svg(res["patch"]["score"], title="activation patching, every position "
                                             "(outlined: retrieval heads)", highlight=retrieval),
        "circuits_patching_last.svg": heatmap_svg(pos.isel(token=-1), title="activation patching, last position",
                                                  highlight=retrieval),
        "circuits_tokens.svg": to_svg(token_chart(per_token_values, [f"L{a}H{b}" for a, b in strongest], tokens,
                                                  title="patching per token (example 0's tokens)", row_title="head")),
        "circuits_atp.svg": heatmap_svg(res["atp"]["score"], title="AtP estimate, every position",
                                        highlight=retrieval),
        "circuits_retrieval.svg": heatmap_svg(res["retrieval"]["score"], title="retrieval score (niah)",
                                              highlight=retrieval),
        "circuits_dla.svg": to_svg(combine(dla_chart(dla, title="direct logit attribution (kv_swap, clean prompts)"))),
        "circuits_direct.svg": to_svg(circuit_chart(circuit_edges(direct, top_k=8),
                                                    title="the 8 strongest direct paths to the logits")),
        "circuits_sinks.svg": heatmap_svg(res["sinks"]["score"], title="attention on the first token"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "images")
    parser.add_argument("--runs", type=Path, default=None, help="run store (default: a temporary directory)")
    args = parser.parse_args()
    from headlab.model import load_model
    from headlab.spec import ModelSpec

    with tempfile.TemporaryDirectory() as tmp:
        run = headlab.run(SPEC, out=args.runs or tmp)
        tok = load_model(ModelSpec(id="headlab-tiny", device="cpu")).tokenizer
        ids = [int(i) for i in run.results["patch_pos"]["input_ids"].isel(example=0).values]
        args.out.mkdir(parents=True, exist_ok=True)
        for name, svg in figures(run, tok.convert_ids_to_tokens(ids)).items():
            (args.out / name).write_text(svg + "\n", encoding="utf-8")
            print("wrote", args.out / name)
        m = measure(run)
    print(f"pairs {m['pairs']}: logit diff clean {m['clean']:.2f}, corrupt {m['corrupt']:.2f}")
    print("retrieval heads:", ", ".join(_label(h) for h in m["retrieval_heads"]))
    print("retrieval top:", ", ".join(f"{_label(h)} {s:.3f}" for h, s in m["retrieval_top"]))
    for key in ("every", "last"):
        print(f"patching ({key}) top 10:", ", ".join(f"{_label(h)} {s:.3f}" for h, s in m[f"{key}_top"]),
              f"| retrieval heads among them {m[f'{key}_found']}, their ranks {m[f'{key}_ranks']}")
    for key in ("atp", "atp_pos", "atp_pos_tail"):
        print(f"{key}: Spearman {m[key]['spearman']:.3f}, top-10 recall {m[key]['top_k_recall']:.2f}")
    print("DLA top:", ", ".join(f"{_label(h)} {s:.3f}" for h, s in m["dla_top"]),
          f"| heads sum {m['dla_heads_sum']:.3f} + rest {m['dla_rest']:.3f} = logit diff {m['logit_diff']:.3f}")
    print(f"sink rate {m['sink_rate']:.2f}; strongest:", ", ".join(f"{_label(h)} {s:.3f}" for h, s in m["sinks_top"]),
          "| massive ratio per layer", [round(v, 1) for v in m["massive_ratio"]])


if __name__ == "__main__":
    main()
