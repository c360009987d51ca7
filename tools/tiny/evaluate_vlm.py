"""Measure ``headlab-tiny-vlm`` on held-out ``shapes`` images; writes ``headlab-tiny-vlm/eval.json``.

Usage (from the repository root)::

    python tools/tiny/evaluate_vlm.py                      # the shipped checkpoint
    python tools/tiny/evaluate_vlm.py --checkpoint DIR --out /tmp/eval.json

Every question is asked twice: with its image and with a blank image (the task's white canvas, no
shapes), so the gap is the model's visual dependence. Examples come from the ``shapes`` task itself
(:func:`headlab.plugins.tasks.shapes.build_shapes`, seed 1000 + k: images the training never drew).

- POPE (presence, ``per_image: 1``: one yes and one no question per image) for each negatives setting:
  accuracy, precision, recall, F1 (yes positive), yes-ratio, with the ``pope`` metric's rule;
- colour and count: the first word of the answer is an accepted answer;
- captions ("Describe the image."): the ``chair`` metric (CHAIR_s, CHAIR_i, mentions per caption) and the
  fraction of the image's objects the caption names (coverage);
- heads: ``segment_divergence`` (VHD over the image tokens) per head, averaged over caption and presence
  prompts, and how concentrated it is (the top heads' share of the total); each head's attention mass on the
  image tokens;
- ``vhr_selection``: VHR's alpha and layers chosen on validation captions; ``vhr_shapes``: the figures of
  ``specs/vhr_shapes.yaml`` recomputed from its stored outputs (``--figure`` draws them).

Greedy decoding through :func:`headlab.generate` (headlab's own attention and KV-cache loop).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
CHECKPOINTS = HERE.parents[1] / "headlab" / "plugins" / "models" / "tiny"  # where the embedded checkpoints ship
DEFAULT = CHECKPOINTS / "headlab-tiny-vlm"


def blank(examples: list[Any]) -> list[Any]:
    """The same examples with each image replaced by a blank canvas of its size (the background colour)."""
    from dataclasses import replace

    from PIL import Image

    from headlab.plugins.tasks.shapes import COLOURS

    return [replace(ex, images=[Image.new("RGB", ex.images[0].size, COLOURS["white"])]) for ex in examples]


def build(question: str, n: int, seed: int, **kw: Any) -> list[Any]:
    from headlab import TaskContext
    from headlab.plugins.tasks.shapes import Shapes, build_shapes

    return build_shapes(Shapes(n=n, question=question, **kw), TaskContext(tokenizer=None, seed=seed, vocab_size=0))


def first_word(text: str) -> str:
    words = text.replace(".", " ").replace(",", " ").split()
    return words[0].lower() if words else ""


def absent_split(examples: list[Any], texts: list[str]) -> dict[str, float]:
    """Accuracy on the ``no`` questions, split by whether the absent object's colour (or shape) is that of an
    object in the image: how much of the answer rests on colour alone."""
    from headlab.plugins.metrics.hallucination import pope_answer

    groups: dict[str, list[bool]] = {}
    for ex, text in zip(examples, texts, strict=True):
        if ex.meta["label"] != "no":
            continue
        colour, shape = ex.meta["object"].split()
        key = ("no_colour_in_image" if any(o.split()[0] == colour for o in ex.meta["objects"])
               else "no_colour_not_in_image")
        groups.setdefault(key, []).append(pope_answer(text) == "no")
        key = "no_shape_in_image" if any(o.split()[1] == shape for o in ex.meta["objects"]) else "no_shape_not_in_image"
        groups.setdefault(key, []).append(pope_answer(text) == "no")
    out = {}
    for key, values in sorted(groups.items()):
        out[key] = round(float(np.mean(values)), 4)
        out[f"{key}_n"] = len(values)
    return out


def colour_mentions(texts: list[str], examples: list[Any]) -> dict[str, float]:
    """Colour-level hallucination of captions: of the mentions (colour + shape word), the fraction whose
    colour is in no object of the image, and the same for the shape word."""
    from headlab.plugins.tasks.shapes import COLOURS, SHAPES

    n = bad_colour = bad_shape = 0
    for text, ex in zip(texts, examples, strict=True):
        words = text.lower().replace(",", " ").replace(".", " ").split()
        colours = {o.split()[0] for o in ex.meta["objects"]}
        shapes = {o.split()[1] for o in ex.meta["objects"]}
        for a, b in zip(words, words[1:], strict=False):
            if a in COLOURS and b in SHAPES:
                n += 1
                bad_colour += a not in colours
                bad_shape += b not in shapes
    return {"colour_hallucination_i": round(bad_colour / n, 4) if n else math.nan,
            "shape_hallucination_i": round(bad_shape / n, 4) if n else math.nan}


def sweep(lm: Any, alphas: tuple[float, ...] = (1.25, 1.5, 2.0),
          layer_sets: tuple[Any, ...] = ("all", (0, 3), (0,), (3,), (0, 1)), n: int = 200,
          seed: int = 200) -> dict[str, Any]:
    """VHR's alpha and layers chosen on validation captions (seed ``seed``, images the spec never uses): every
    (alpha, layers) of the grid against greedy; ``selected`` is the setting of lowest CHAIR_i, the one
    ``vhr_shapes.yaml`` runs on its own (test) images."""
    import headlab
    from headlab.plugins.metrics.hallucination import Chair, chair_aggregate

    caps = build("caption", n, seed)

    def score(steer: list[dict[str, Any]]) -> dict[str, float]:
        texts = headlab.generate(lm, caps, steer=steer, max_new_tokens=40, batch_size=32).texts
        c = chair_aggregate(Chair(), caps, texts, np.zeros(len(caps)))
        return {"chair_s": round(c["s"], 4), "chair_i": round(c["i"], 4), "mentions": round(c["mentions"], 4),
                **coverage(texts, caps)}

    out: dict[str, Any] = {"captions": n, "seed": seed, "greedy": score([])}
    print("validation greedy", out["greedy"], flush=True)
    grid = []
    for alpha in alphas:
        for layers in layer_sets:
            steer = [{"kind": "vhr", "alpha": alpha, "layers": layers if layers == "all" else list(layers)}]
            res = {"alpha": alpha, "layers": steer[0]["layers"], **score(steer)}
            grid.append(res)
            print("validation vhr", res, flush=True)
    out["grid"] = grid
    best = min(grid, key=lambda r: r["chair_i"])
    out["selected"] = {"alpha": best["alpha"], "layers": best["layers"]}
    return out


def coverage(texts: list[str], examples: list[Any]) -> dict[str, float]:
    """The fraction of each image's objects its caption names (mean): a steering that lowers hallucination by
    naming less shows here."""
    from headlab.plugins.metrics.hallucination import ObjectMatcher, default_synonyms

    matcher = ObjectMatcher(default_synonyms())
    cover = [len(set(matcher.mentions(t)) & set(ex.meta["objects"])) / len(ex.meta["objects"])
             for t, ex in zip(texts, examples, strict=True)]
    return {"coverage": round(float(np.mean(cover)), 4)}


def evaluate(lm: Any, model: Any, n: int = 100, batch_size: int = 32) -> dict[str, Any]:
    """The measurements on ``lm`` (``model``: how a spec names it, for the VHD run)."""
    import headlab
    from headlab.plugins.metrics.hallucination import (
        Chair,
        PopeMetric,
        chair_aggregate,
        pope_aggregate,
    )

    def gen(exs: list[Any], new: int) -> list[str]:
        return headlab.generate(lm, exs, max_new_tokens=new, batch_size=batch_size).texts

    out: dict[str, Any] = {"n_images": n}
    pope: dict[str, Any] = {}
    for k, setting in enumerate(("random", "popular", "adversarial")):
        exs = build("presence", n, 1000 + k, negatives=setting)
        pope[setting] = {}
        for name, rows in (("image", exs), ("blank", blank(exs))):
            texts = gen(rows, 3)
            pope[setting][name] = {key: round(v, 4) for key, v in
                                   pope_aggregate(PopeMetric(), rows, texts, np.zeros(len(rows))).items()}
            pope[setting][name].update(absent_split(rows, texts))
        pope[setting]["questions"] = len(exs)
        print(f"POPE {setting}: {pope[setting]}", flush=True)
    out["pope"] = pope
    for k, question in enumerate(("colour", "count")):
        exs = build(question, n, 1010 + k)
        res: dict[str, Any] = {"questions": len(exs)}
        for name, rows in (("image", exs), ("blank", blank(exs))):
            texts = gen(rows, 3)
            res[name] = round(float(np.mean([first_word(t) in ex.meta["answers"] for t, ex in zip(texts, rows,
                                                                                                strict=True)])), 4)
        out[question] = res
        print(f"{question}: {res}", flush=True)
    exs = build("caption", n, 1020)
    cap: dict[str, Any] = {"captions": len(exs)}
    for name, rows in (("image", exs), ("blank", blank(exs))):
        texts = gen(rows, 40)
        agg = chair_aggregate(Chair(), rows, texts, np.zeros(len(rows)))
        colours = colour_mentions(texts, rows)
        cap[name] = {"chair_s": round(agg["s"], 4), "chair_i": round(agg["i"], 4),
                     "mentions": round(agg["mentions"], 4), **coverage(texts, rows),
                     **colours,
                     "examples": [{"objects": ex.meta["objects"], "caption": t} for ex, t in zip(rows[:5], texts[:5],
                                                                                                 strict=True)]}
    out["caption"] = cap
    print(f"caption: { {k: {kk: vv for kk, vv in v.items() if kk != 'examples'} if isinstance(v, dict) else v for k, v in cap.items()} }",
          flush=True)
    out["heads"] = heads(model, n=min(64, n))
    return out


def heads(model: Any, n: int = 64) -> dict[str, Any]:
    """VHD (segment_divergence over the image) per head on caption and presence prompts."""
    import headlab

    spec = {"name": "vhd", "model": model, "task": {"kind": "shapes", "n": n, "question": "caption", "seed": 1030},
            "steps": [{"id": "caption", "detect": {"kind": "segment_divergence"}},
                      {"id": "presence", "task": {"kind": "shapes", "n": n // 2, "question": "presence",
                                                  "seed": 1031},
                       "detect": {"kind": "segment_divergence"}}]}
    with tempfile.TemporaryDirectory() as tmp:
        run = headlab.run(spec, out=tmp)
        res: dict[str, Any] = {}
        for step in ("caption", "presence"):
            score = run.results[step]["score"].values.astype(float)  # (layer, head)
            flat = score.ravel()
            order = np.argsort(-flat)
            L, H = score.shape
            total = flat.sum()
            res[step] = {
                "score": np.round(score, 4).tolist(),
                "top": [[int(i // H), int(i % H), round(float(flat[i]), 4)] for i in order[:8]],
                "top4_share": round(float(flat[order[:4]].sum() / total), 4),
                "top8_share": round(float(flat[order[:8]].sum() / total), 4),
                "uniform_share_4": round(4 / flat.size, 4),
                "per_layer_max_over_median": [round(float(score[ly].max() / np.median(score[ly])), 3) for ly in range(L)],
            }
            print(f"VHD {step}: top {res[step]['top'][:6]} top4 share {res[step]['top4_share']}", flush=True)
    return res


def image_attention(checkpoint: Path, n: int = 32, seed: int = 5) -> list[list[float]]:
    """(layer, head): the attention mass on the image tokens at the positions that predict answer tokens, on
    ``n`` rows in the training format with a caption each (``train_vlm.image_attention``): which heads read the
    image at all."""
    import importlib.util

    from transformers import LlavaForConditionalGeneration

    spec = importlib.util.spec_from_file_location("train_vlm", HERE / "train_vlm.py")
    tv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tv)
    tok = tv.build_tokenizer()
    data = tv.Data(tok, tv.build_processor(tok), seed, caption_p=1.0)
    ids, lab, att, pv, *_ = data.batch(n)
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=att, pixel_values=pv, output_attentions=True)
    mass = tv.image_attention(out.attentions, ids, lab, data.image_id)
    return [[round(float(v), 3) for v in row] for row in mass]


def steering(model: Any, spec_path: Path) -> dict[str, Any]:
    """Run ``specs/vhr_shapes.yaml`` on ``model`` and score each generate step with its metric's aggregates
    (``chair``: CHAIR_s, CHAIR_i, mentions; ``pope``: accuracy, precision, recall, F1, yes-ratio), recomputed
    from the stored outputs and the task's examples."""
    import yaml

    import headlab
    from headlab import TaskContext
    from headlab.plugins.tasks.shapes import Shapes, build_shapes
    from headlab.scoring import metric_values

    spec = yaml.safe_load(spec_path.read_text())
    spec["model"] = model
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        run = headlab.run(spec, out=tmp)
        seed = int(run.attrs.get("seed", 0))
        out["digest"] = run.attrs.get("model_digest") or run.attrs.get("digest")
        for step in spec["steps"]:
            if "generate" not in step:
                continue
            task = dict(step.get("task") or spec["task"])
            task.pop("kind")
            examples = build_shapes(Shapes(**task), TaskContext(tokenizer=None, seed=seed, vocab_size=0))
            ds = run.results[step["id"]]
            texts = [str(t) for t in ds["output"].values]
            assert [str(p) for p in ds["prompt"].values] == [ex.prompt for ex in examples]
            res: dict[str, Any] = {}
            for metric in step["generate"].get("metrics", []):
                values = metric_values(metric, examples, texts)
                res.update({k: round(float(v.values.mean()), 4) for k, v in values.items()})
                if metric == "chair":
                    res.update(coverage(texts, examples))
            if "vhr_selected" in ds:
                res["vhr_heads_per_example"] = round(float(ds["vhr_selected"].sum(["layer", "head"]).mean()), 2)
            res["examples"] = [[ex.meta.get("scene"), t] for ex, t in zip(examples[:3], texts[:3], strict=True)]
            out[step["id"]] = res
            print(step["id"], {k: v for k, v in res.items() if k != "examples"}, flush=True)
        score = run.results["vhd"]["score"].values
        flat = np.argsort(-score.ravel())
        out["vhd_top16"] = [[int(i // score.shape[1]), int(i % score.shape[1])] for i in flat[:16]]
    return out


def figure(result: dict[str, Any], path: Path) -> None:
    """Bar chart of CHAIR_s per caption step of ``vhr_shapes`` (docs/images/vhr_shapes.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = {k: v for k, v in result["vhr_shapes"].items() if isinstance(v, dict) and "chair_s" in v}
    colour = {"greedy": "#777777", "vhr": "#1f77b4", "vhr_paper": "#9ecae1", "vhd_heads": "#6baed6"}
    names = list(steps)
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.bar(range(len(names)), [steps[n]["chair_s"] for n in names],
           color=[colour.get(n, "#fdae6b" if n.startswith("layer_random") else "#e6550d") for n in names])
    ax.axhline(steps["greedy"]["chair_s"], color="#777777", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("CHAIR_s (lower is better)")
    ax.set_title("headlab-tiny-vlm, 300 held-out captions: greedy, VHR, VHD heads, random heads "
                 "(all layers; layers 0+3)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None, help="a checkpoint directory (default: the shipped one)")
    ap.add_argument("--out", type=Path, default=None, help="default: <checkpoint>/eval.json")
    ap.add_argument("--n", type=int, default=100, help="images per question kind")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--spec", type=Path, default=HERE.parents[1] / "specs" / "vhr_shapes.yaml",
                    help="the VHR demonstration spec (its figures go under vhr_shapes)")
    ap.add_argument("--no-spec", action="store_true", help="skip the spec")
    ap.add_argument("--figure", type=Path, default=None,
                    help="only draw the vhr_shapes chart (e.g. docs/images/vhr_shapes.png) from an existing eval.json")
    args = ap.parse_args(argv)
    if args.figure is not None:
        figure(json.loads((args.out or DEFAULT / "eval.json").read_text()), args.figure)
        print(f"wrote {args.figure}", flush=True)
        return
    torch.set_num_threads(args.threads)
    from headlab.model import from_pretrained, load_model
    from headlab.spec import ModelSpec

    t0 = time.time()
    if args.checkpoint is None:
        model: Any = "headlab-tiny-vlm"
        lm = load_model(ModelSpec(id=model, device="cpu"))
        out_path = args.out or DEFAULT / "eval.json"
    else:
        model = {"path": str(args.checkpoint)}
        lm = from_pretrained(str(args.checkpoint), ModelSpec(device="cpu"), name=str(args.checkpoint))
        out_path = args.out or args.checkpoint / "eval.json"
    result = {"checkpoint": lm.name, "digest": lm.digest, **evaluate(lm, model, args.n)}
    result["heads"]["image_attention"] = image_attention(args.checkpoint or DEFAULT)
    print("image attention mass per head", result["heads"]["image_attention"], flush=True)
    if not args.no_spec and args.spec.is_file():
        result["vhr_selection"] = sweep(lm)
        result["vhr_shapes"] = steering(model, args.spec)
    result["minutes"] = round((time.time() - t0) / 60, 1)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_path}", flush=True)


if __name__ == "__main__":
    main()
