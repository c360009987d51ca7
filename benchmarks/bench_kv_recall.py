"""Needle recall of headlab's ``streaming`` KV policy and kvpress's ``DuoAttentionPress`` on the same head mask,
side by side on the embedded model ``headlab-tiny`` (issue [kv-heads]: "needle recall equal to kvpress's on the
same mask").

    python benchmarks/bench_kv_recall.py [--lengths 1024 2048] [--depths 5] [--full-kv-heads 3:0 3:1 3:2 3:3] [--write]
        [--detect] [--sink 4] [--window 128] [--new 8] [--threads 1]
        [--kvpress-python .venv-kvpress/bin/python] [--prompts-out PATH]

The needle prompts are those of ``specs/kv_compression.yaml``'s task (headlab's ``niah`` generator, its needles
and seed), on the grid ``--lengths`` x ``--depths`` x 3 needles. Cases, all greedy, ``--new`` new tokens, batch 1:

- ``headlab full``, ``headlab streaming``, ``headlab streaming, prefill: full`` and ``headlab streaming, prefill:
  full, question_tokens: 1``: one headlab run (``generate`` steps with ``kv: {kind: full}``, ``kv: {kind:
  streaming, full_heads: ..., sink, window}``, the same with ``prefill: full``, and with ``question_tokens: 1``
  as well; metric ``needle_recall``). Under ``streaming`` (``prefill: bounded``, the default) a compressed KV head
  attends its ``sink`` first and ``window`` most recent tokens in the prefill as in decode (the issue's
  definition); with ``prefill: full`` every head attends the whole prompt in the prefill, and the cache then
  keeps only the compressed heads' sinks and window (kvpress's design); ``question_tokens: 1`` prefills the
  prompt but its last token so, and feeds that token after the compression (kvpress's context/question split,
  the split the kvpress cases below use).
- ``kvpress full`` and ``kvpress DuoAttentionPress``: in kvpress's own virtual environment
  (``--kvpress-python``; kvpress 0.5.5 pins transformers < 5.3), kvpress's ``KVPressTextGenerationPipeline``
  (``pipeline("kv-press-text-generation")``) without a press and with ``headlab.kv.to_kvpress`` of the same
  head map (``sink_size = sink``, ``recent_size = window - 1``). The pipeline's forward runs on headlab's
  token ids: the prompt but its last token is its *context* (prefilled, then compressed by the press), the
  last token its *question* (kvpress's own tokenisation would add a BOS and a newline, and so change the
  prompt). kvpress prefills every head in full and compresses after the prefill.

Answers are scored by headlab's ``needle_recall`` metric (ROUGE-1 recall of the answer > 0.5), in each
environment. Printed: the recall per case and per length, and the per-prompt agreement of the answers; the two
``full`` cases must give the same answer on every prompt (else the exit status is 1). docs/kv.md ("Needle
recall: headlab and kvpress on the same mask") has the numbers and explains the gap.

``--full-kv-heads`` (``layer:kv_head``; default layer 3's 4 KV heads, the top 4 KV heads by retrieval score of
``headlab-tiny``, docs/kv.md) or ``--detect`` (a ``retrieval`` step as in the spec; ``full_heads: {from:
retrieval, top: 4}``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny"
SPEC = ROOT / "specs" / "kv_compression.yaml"
QUESTION_CASE = "headlab streaming, prefill: full, question_tokens: 1"
HEADLAB_CASES = ("headlab full", "headlab streaming", "headlab streaming, prefill: full", QUESTION_CASE)
KVPRESS_CASES = ("kvpress full", "kvpress DuoAttentionPress")


def kv_pair(text: str) -> tuple[int, int]:
    """``layer:kv_head`` as a pair of ints."""
    layer, _, head = text.partition(":")
    return int(layer), int(head)


def bench_spec(args: argparse.Namespace, group: int) -> dict:
    """The headlab spec: the needle task of ``specs/kv_compression.yaml`` on the benchmark's grid, a ``full``, a
    ``streaming``, a ``streaming`` with ``prefill: full`` and one with ``prefill: full, question_tokens: 1``
    generate step (batch 1)."""
    from ruamel.yaml import YAML

    base = YAML(typ="safe").load(SPEC.read_text(encoding="utf-8"))
    task = dict(base["task"], context_lengths=list(args.lengths), depths=args.depths)
    steps = []
    if args.detect:
        retrieval = next(s for s in base["steps"] if s["id"] == "retrieval")
        steps.append(retrieval)
        full_heads: object = {"from": "retrieval", "top": args.top}
    else:  # one query head of each KV head: full under gqa `any`
        full_heads = [[layer, head * group] for layer, head in args.full_kv_heads]
    generate = {"metrics": ["needle_recall"], "max_new_tokens": args.new, "batch_size": 1}
    steps.append({"id": "full", "generate": dict(generate, kv={"kind": "full"})})
    streaming = {"kind": "streaming", "full_heads": full_heads, "sink": args.sink, "window": args.window}
    steps.append({"id": "streaming", "generate": dict(generate, kv=streaming)})
    steps.append({"id": "streaming_prefill_full", "generate": dict(generate, kv=dict(streaming, prefill="full"))})
    steps.append({"id": "streaming_question", "generate": dict(generate, kv=dict(streaming, prefill="full",
                                                                                   question_tokens=1))})
    return {"name": "bench_kv_recall", "model": base["model"], "task": task, "steps": steps, "seed": base["seed"]}


def needle_scores(prompts: list[dict], outputs: list[str]) -> list[float]:
    """headlab's ``needle_recall`` metric (defaults: ROUGE-1 recall of the answer > 0.5) of each output."""
    from headlab import Example
    from headlab.plugins.metrics.rouge import NeedleRecall, needle_recall

    examples = [Example(prompt=p["prompt"], target=" " + p["answer"], meta={"answer": p["answer"]}) for p in prompts]
    return [float(v) for v in needle_recall(NeedleRecall(), examples, outputs)]


def run_kvpress(path: Path, threads: int) -> dict:
    """The kvpress cases on the prompts of ``path`` (run in kvpress's environment): answers and recall."""
    import torch
    import transformers
    import xarray as xr
    from kvpress import KVPressTextGenerationPipeline  # noqa: F401  (registers "kv-press-text-generation")

    from headlab.kv import HeadMap, to_kvpress

    if threads:
        torch.set_num_threads(threads)
    data = json.loads(path.read_text(encoding="utf-8"))
    head_map = HeadMap(xr.DataArray(data["kv_full"], dims=("layer", "kv_head")).astype(bool), sink=data["sink"],
                       window=data["window"], attrs={"policy": "streaming"})
    press = to_kvpress(head_map)
    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    pipe = transformers.pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    answers: dict[str, list[str]] = {case: [] for case in KVPRESS_CASES}
    for p in data["prompts"]:
        ids = torch.tensor(p["input_ids"])[None]
        inputs = {"context_ids": ids[:, :-1], "questions_ids": [ids[:, -1:]]}
        for case, pr in zip(KVPRESS_CASES, (None, press), strict=True):
            out = pipe.forward(inputs, press=pr, max_new_tokens=data["new"], cache=None)
            answers[case].append(pipe.postprocess(out, single_question=True)["answer"])
    return {"answers": answers,
            "recall": {case: needle_scores(data["prompts"], outs) for case, outs in answers.items()},
            "press": f"{type(press).__name__}(sink_size={press.sink}, recent_size={press.recent})",
            "versions": {"kvpress": _version("kvpress"), "transformers": transformers.__version__}}


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def run_headlab(args: argparse.Namespace) -> tuple[list[dict], dict, dict, dict]:
    """The headlab cases: (prompts, answers per case, recall per case, the streaming step's head map)."""
    import numpy as np
    import torch

    import headlab

    if args.threads:
        torch.set_num_threads(args.threads)
    config = json.loads((TINY / "config.json").read_text(encoding="utf-8"))
    group = config["num_attention_heads"] // config["num_key_value_heads"]
    run = headlab.run(bench_spec(args, group), out=Path(tempfile.mkdtemp(prefix="bench-kv-recall-")))
    full, streaming, after = run.results["full"], run.results["streaming"], run.results["streaming_prefill_full"]
    question = run.results["streaming_question"]
    prompts = []
    for i in range(full.sizes["example"]):
        ids = [int(t) for t in full["input_ids"].values[i] if t >= 0]
        prompts.append({"prompt": str(full["prompt"].values[i]), "input_ids": ids,
                        "answer": str(full["answer"].values[i]),
                        "context_length": int(full["context_length"].values[i]),
                        "depth": float(full["depth"].values[i]), "needle_index": int(full["needle_index"].values[i])})
    kv_full = streaming["kv_full"].transpose("layer", "kv_head")
    cases = dict(zip(HEADLAB_CASES, (full, streaming, after, question), strict=True))
    answers = {case: [str(x) for x in ds["output"].values] for case, ds in cases.items()}
    recall = {case: [float(x) for x in ds["needle_recall"].values] for case, ds in cases.items()}
    return prompts, answers, recall, {"kv_full": np.asarray(kv_full.values, dtype=bool).tolist(),
                                      "kept_fraction": float(streaming.attrs["kv_kept_fraction"]),
                                      "prefill_full_kept_fraction": float(after.attrs["kv_kept_fraction"]),
                                      "question_kept_fraction": float(question.attrs["kv_kept_fraction"]),
                                      "prefill_full_attention": str(after.attrs["kv_attention"]),
                                      "question_attention": str(question.attrs["kv_attention"])}


def agreement(prompts: list[dict], answers: dict, recall: dict, a: str, b: str, show: bool = True) -> int:
    """Print how many prompts ``a`` and ``b`` answer alike (and alike in recall), with the differing ones;
    returns the number of differing answers."""
    diff = [i for i, (x, y) in enumerate(zip(answers[a], answers[b], strict=True)) if x != y]
    same_recall = sum(x == y for x, y in zip(recall[a], recall[b], strict=True))
    n = len(prompts)
    print(f"{a} vs {b}: same answer {n - len(diff)}/{n}, same recall {same_recall}/{n}")
    for i in diff if show else []:
        p = prompts[i]
        print(f"  {p['context_length']:>5} depth {p['depth']:.2f} needle {p['needle_index']}: "
              f"{answers[a][i].strip()!r} ({recall[a][i]:.0f}) vs {answers[b][i].strip()!r} ({recall[b][i]:.0f})")
    return len(diff)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="needle context lengths")
    p.add_argument("--depths", type=int, default=5, help="needle depths per length")
    p.add_argument("--full-kv-heads", type=kv_pair, nargs="+", default=[(3, 0), (3, 1), (3, 2), (3, 3)],
                   metavar="LAYER:KV_HEAD", help="the KV heads kept in full")
    p.add_argument("--detect", action="store_true",
                   help="detect retrieval heads (as the spec) and keep the top --top KV heads in full instead")
    p.add_argument("--top", type=int, default=4, help="with --detect: the number of full KV heads")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--new", type=int, default=8, help="new tokens (greedy)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch default)")
    p.add_argument("--kvpress-python", default=str(ROOT / ".venv-kvpress" / "bin" / "python"),
                   help="the interpreter of kvpress's virtual environment (with headlab installed, --no-deps)")
    p.add_argument("--prompts-out", type=Path, default=None, help="keep the prompts (JSON) at this path")
    p.add_argument("--_kvpress", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._kvpress is not None:
        print(json.dumps(run_kvpress(args._kvpress, args.threads)))
        return

    prompts, answers, recall, stream = run_headlab(args)
    path = args.prompts_out or Path(tempfile.mkdtemp(prefix="bench-kv-recall-")) / "prompts.json"
    path.write_text(json.dumps({"prompts": prompts, "kv_full": stream["kv_full"], "sink": args.sink,
                                "window": args.window, "new": args.new}), encoding="utf-8")
    r = subprocess.run([args.kvpress_python, __file__, "--_kvpress", str(path), "--threads", str(args.threads)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kvpress cases failed (rc={r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}")
    kv = json.loads(r.stdout.strip().splitlines()[-1])
    answers.update(kv["answers"])
    recall.update(kv["recall"])

    full_heads = [(i, j) for i, row in enumerate(stream["kv_full"]) for j, f in enumerate(row) if f]
    lengths = sorted({q["context_length"] for q in prompts})
    print(f"headlab-tiny, {len(prompts)} needle prompts ({len(lengths)} lengths x {args.depths} depths x 3 needles), "
          f"greedy, {args.new} new tokens; full KV heads {full_heads}, sink {args.sink}, window {args.window} "
          f"(kept fraction: streaming {stream['kept_fraction']:.3f}, prefill: full "
          f"{stream['prefill_full_kept_fraction']:.3f}, question_tokens: 1 {stream['question_kept_fraction']:.3f}; "
          f"they differ only where an answer stops at another length); "
          f"kvpress {kv['versions']['kvpress']} (transformers {kv['versions']['transformers']}), press {kv['press']}; prompts: {path}")
    print(f"prefill: full's attention paths: {stream['prefill_full_attention']}")
    print(f"question_tokens: 1's attention paths: {stream['question_attention']}")
    print("\n| case | needle recall | " + " | ".join(str(n) for n in lengths) + " |")
    print("|---|---|" + "---|" * len(lengths))
    for case in (*HEADLAB_CASES, *KVPRESS_CASES):
        by_length = [sum(v for v, q in zip(recall[case], prompts, strict=True) if q["context_length"] == n)
                     / sum(q["context_length"] == n for q in prompts) for n in lengths]
        print(f"| {case} | {sum(recall[case]) / len(prompts):.2f} | " + " | ".join(f"{v:.2f}" for v in by_length)
              + " |")
    print()
    mismatched = agreement(prompts, answers, recall, "headlab full", "kvpress full")
    agreement(prompts, answers, recall, "headlab streaming", "kvpress DuoAttentionPress")
    agreement(prompts, answers, recall, "headlab streaming, prefill: full", "kvpress DuoAttentionPress")
    agreement(prompts, answers, recall, QUESTION_CASE, "kvpress DuoAttentionPress")
    for a, b in (("headlab streaming", "headlab streaming, prefill: full"),
                 ("headlab streaming, prefill: full", QUESTION_CASE),
                 ("headlab full", "headlab streaming, prefill: full"),
                 ("kvpress full", "kvpress DuoAttentionPress")):
        agreement(prompts, answers, recall, a, b, show=False)
    if mismatched:
        sys.exit(f"the two full runs differ on {mismatched} prompts")
    print("\nthe two full runs agree on every answer")


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
