"""Retrieval-head detection over a niah grid: headlab batched vs the reference's batch-1 eager loop.

    python benchmarks/bench_retrieval.py [--model headlab-tiny] [--lengths 256 512 1024] [--depths 5] [--write]
        [--needles 3] [--max-new-tokens 24] [--batch-size 16] [--threads 2] [--device cpu] [--random-weights]

Same model, same examples, same greedy decoding length; each method runs in a fresh subprocess (so peak
memory is its own), after one untimed warm-up example; the time is the fastest of ``--repeats`` runs:

- ``headlab``: :func:`headlab.plugins.detectors.retrieval.retrieval_scores`, ``--batch-size`` examples
  per batch (grouped by length), prefill through SDPA, decode steps through the streaming argmax probe;
- ``reference``: Wu et al.'s method as their code runs it: one example at a time, prefill of the prompt
  minus its last token with fast attention (SDPA here: headlab's attention outside ``instrument``), then greedy decode steps with eager attention and
  ``output_attentions=True``, the top-1 key of every (layer, head) taken with ``topk(1)`` in Python loops;
- ``reference-vec``: the same batch-1 eager decode, scoring vectorised over layers and heads (how much of
  the gap is the reference's Python loops rather than batch 1 + eager attention).

Prints instances/second side by side, the ratios, peak memory growth (``torch.cuda.max_memory_allocated``
on CUDA, ``ru_maxrss`` growth on CPU) and the largest difference between the methods' per-instance
scores (they compute the same numbers).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def load(args):
    import torch

    from headlab.context import TaskContext
    from headlab.model import load_model
    from headlab.plugins.tasks.synthetic_tasks import Niah, build_niah
    from headlab.spec import ModelSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = ModelSpec(path=args.model, device=args.device) if "/" in args.model else ModelSpec(
        id=args.model, device=args.device)
    lm = load_model(spec)
    if args.random_weights:  # same architecture and tokenizer, seeded random weights (decodes every step)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        lm.model = AutoModelForCausalLM.from_config(lm.model.config, attn_implementation="headlab").to(
            lm.model.device).eval()
    task = Niah(context_lengths=args.lengths, depths=args.depths, needles=args.needles)
    examples = build_niah(task, TaskContext(tokenizer=lm.tokenizer, seed=0, vocab_size=0))
    return lm, examples


def reference_scores(lm, examples, max_new: int, vectorised: bool):
    """Batch-1: SDPA prefill of prompt[:-1], eager decode with output_attentions, top-1 per head."""
    import numpy as np
    import torch

    from headlab.generation import tokenize

    model = lm.model
    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    eos = set(lm.eos_ids)
    out = np.zeros((len(examples), L, H))
    for n, ex in enumerate(examples):
        batch = tokenize(lm, [ex])
        s, e = batch.token_span(0, *ex.spans["needle"][0])
        ids = batch.input_ids
        prompt = ids[0].tolist()
        with torch.no_grad():
            model.set_attn_implementation("headlab")  # outside instrument(): exactly SDPA
            q = model(input_ids=ids[:, :-1], use_cache=True)
            model.set_attn_implementation("eager")
            past, inp = q.cache, ids[0, -1]
            for _ in range(max_new):
                o = model(input_ids=inp.view(1, 1), cache=past, use_cache=True, output_attentions=True)
                past = o.cache
                inp = o.logits[0, -1].argmax()
                tok = int(inp)
                if vectorised:
                    top = torch.stack([a[0, :, -1] for a in o.attentions]).argmax(-1)  # (L, H)
                    hit = (top >= s) & (top < e) & (torch.tensor(prompt, device=top.device)[top.clamp(max=len(prompt) - 1)]
                                                    == tok)
                    out[n] += hit.double().cpu().numpy() / (e - s)
                else:
                    for layer in range(L):
                        for head in range(H):
                            values, idx = o.attentions[layer][0][head][-1].topk(1)
                            for i in idx:
                                if s <= i < e and tok == prompt[int(i)]:
                                    out[n, layer, head] += 1 / (e - s)
                                    break
                if tok in eos:
                    break
    model.set_attn_implementation("headlab")
    return out


def worker(args) -> dict:
    import numpy as np
    import torch

    from headlab.plugins.detectors.retrieval import retrieval_scores

    lm, examples = load(args)
    cuda = args.device.startswith("cuda")

    def run(exs):
        if args.method == "headlab":
            return retrieval_scores(lm, exs, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)[0]
        return reference_scores(lm, exs, args.max_new_tokens, vectorised=args.method == "reference-vec")

    run(examples[:1])  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(args.repeats):  # the fastest of a few runs: the machine may be shared
        t = time.perf_counter()
        scores = run(examples)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    seconds = min(times)
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0)
    np.save(args.scores_out, scores)
    return {"method": args.method, "instances": len(examples), "seconds": seconds,
            "instances_per_s": len(examples) / seconds, "peak_bytes": int(peak),
            "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="headlab-tiny")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--depths", type=int, default=5)
    p.add_argument("--needles", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method (the fastest counts)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--random-weights", action="store_true",
                   help="re-initialise the model's weights (seeded): every example decodes all new tokens")
    p.add_argument("--methods", nargs="+", default=["headlab", "reference", "reference-vec"])
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--scores-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.method:
        print(json.dumps(worker(args)))
        return

    import tempfile

    import numpy as np

    results, scores = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            out = f"{tmp}/{method}.npy"
            cmd = [sys.executable, __file__, "--method", method, "--scores-out", out, "--model", args.model,
                   "--lengths", *map(str, args.lengths), "--depths", str(args.depths), "--needles",
                   str(args.needles), "--max-new-tokens", str(args.max_new_tokens), "--batch-size",
                   str(args.batch_size), "--threads", str(args.threads), "--device", args.device,
                   "--repeats", str(args.repeats)]
            cmd += ["--random-weights"] if args.random_weights else []
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{method} failed:\n{proc.stderr[-3000:]}")
            results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
            scores[method] = np.load(out)
    base = results.get("headlab")
    for method, r in results.items():
        r["max_abs_score_diff_vs_headlab"] = float(np.abs(scores[method] - scores["headlab"]).max()) if base else None
        r["speedup_of_headlab"] = base["instances_per_s"] / r["instances_per_s"] if base else None
    if args.json:
        print(json.dumps(results, indent=1))
        return
    n = next(iter(results.values()))["instances"]
    print(f"retrieval detection, model {args.model}, {n} niah instances (lengths {args.lengths}, "
          f"{args.depths} depths, {args.needles} needles), {args.max_new_tokens} new tokens, device {args.device}, "
          f"threads {next(iter(results.values()))['threads']}")
    print(f"{'method':<15}{'inst/s':>10}{'seconds':>10}{'peak MiB':>10}{'headlab x':>11}{'max |diff|':>12}")
    for method, r in results.items():
        print(f"{method:<15}{r['instances_per_s']:>10.2f}{r['seconds']:>10.1f}{r['peak_bytes'] / 2**20:>10.1f}"
              f"{r['speedup_of_headlab']:>11.2f}{r['max_abs_score_diff_vs_headlab']:>12.2e}")


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
