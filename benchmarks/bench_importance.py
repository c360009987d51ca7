"""Head importance, side by side in one run (not a test): gradient importance against a per-head masking loop,
and Ships batched against the reference's per-head batch-1 loop, with the ratios printed.

    python benchmarks/bench_importance.py --threads 1 [--write]    # the full size: a random 8 x 16 Llama
    python benchmarks/bench_importance.py --layers 2 --prompts 2  # a check that everything runs

One seeded random Llama (``--layers`` x ``--heads`` heads x head dim 32, MLP twice the width, vocabulary 32000;
nothing downloaded) is built twice with the same weights: under headlab's attention (the detectors) and under
transformers' SDPA (the loops, plain transformers code with hooks or weight surgery). The prompts are random
token sequences of ``--tokens`` tokens.

- ``gradient``: the ``head_importance`` detector (``metric: logit_diff`` of two random answer tokens per prompt,
  ``abs: per_example``: one forward and one backward over the prompts) against what it replaces, measuring each
  head's effect by masking it: one forward of all prompts with that head's output zeroed (a pre-hook on
  ``o_proj``), per head, plus the unmasked forward (``1 + L * H`` forwards, last-position logits only). Target:
  at least ``L * H / 4`` faster.
- ``ships``: the ``ships`` detector (``batch_size`` rows per forward) against the reference's loop
  (ydyjya/SafetyHeadAttribution): per prompt, the unablated forward and one forward per head at batch 1 with
  that head's query-projection rows scaled by epsilon (``1 + L * H`` forwards per prompt, full logits as the
  reference computes them); the maximum difference of the scores is printed. Target: at least 5x on a CPU.
- ``composition``: the ``composition`` detector against TransformerLens ``all_composition_scores`` on the same
  weights (time, peak memory, largest difference): this part runs ``benchmarks/bench_composition.py``, which keeps
  TransformerLens in its own environment (``--tl-python``) and prints its own table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _common import random_llama


def build(args: argparse.Namespace):
    """``(LoadedModel under headlab's attention, the same weights under SDPA)``."""
    from headlab.model import LoadedModel, geometry_of

    kw = dict(layers=args.layers, heads=args.heads, head_dim=32, vocab=32000)
    model = random_llama("headlab", "cpu", "float32", **kw)
    plain = random_llama("sdpa", "cpu", "float32", **kw)
    plain.load_state_dict(model.state_dict())
    return LoadedModel(model=model, tokenizer=None, name="random", geometry=geometry_of(model)), plain


def examples(args: argparse.Namespace) -> list:
    """Random prompts with two random answer tokens each (``meta["answer_id"]`` / ``meta["wrong_id"]``)."""
    from headlab import Example

    rng = np.random.default_rng(0)
    out = []
    for i in range(args.prompts):
        ids = rng.integers(10, 32000, args.tokens).tolist()
        a, w = rng.integers(10, 32000, 2).tolist()
        out.append(Example(prompt=f"random {i}", input_ids=ids, meta={"answer_id": a, "wrong_id": w}))
    return out


def timed(fn, reps: int):
    """``(result, best wall time over reps)``."""
    best, result = float("inf"), None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def gradient(lm, plain, exs, args) -> dict:
    from headlab import StepContext
    from headlab.plugins.detectors.head_importance import HeadImportance, detect

    ctx = StepContext(model=lm, examples=exs, results={}, seed=0)
    config = HeadImportance(metric="logit_diff", normalize="none", batch_size=len(exs))
    ds, t_grad = timed(lambda: detect(config, ctx), args.reps)
    L, H, D = args.layers, args.heads, 32
    ids = torch.tensor([ex.input_ids for ex in exs])
    a = torch.tensor([ex.meta["answer_id"] for ex in exs])
    w = torch.tensor([ex.meta["wrong_id"] for ex in exs])

    def metric() -> torch.Tensor:
        logits = plain(input_ids=ids, logits_to_keep=1).logits[:, -1].double()
        return logits.gather(1, a[:, None])[:, 0] - logits.gather(1, w[:, None])[:, 0]

    def loop() -> np.ndarray:
        out = np.zeros((L, H))
        with torch.no_grad():
            base = metric()
            for layer in range(L):
                proj = plain.model.layers[layer].self_attn.o_proj
                for head in range(H):
                    def zero(module, args_, head=head):
                        z = args_[0].clone()
                        z[..., head * D:(head + 1) * D] = 0
                        return (z, *args_[1:])

                    handle = proj.register_forward_pre_hook(zero)
                    try:
                        out[layer, head] = (base - metric()).abs().mean().item()
                    finally:
                        handle.remove()
        return out

    masked, t_loop = timed(loop, args.reps)
    rho = np.corrcoef(ds["raw"].values.ravel(), masked.ravel())[0, 1]
    return {"headlab": t_grad, "loop": t_loop, "ratio": t_loop / t_grad, "target": L * H / 4,
            "pearson": float(rho)}


def ships(lm, plain, exs, args) -> dict:
    from headlab import StepContext
    from headlab.plugins.detectors.ships import Ships, detect

    ctx = StepContext(model=lm, examples=exs, results={}, seed=0)
    config = Ships(batch_size=args.batch_size)
    ds, t_batched = timed(lambda: detect(config, ctx), args.reps)
    L, H, D, eps = args.layers, args.heads, 32, config.epsilon

    def kl(p, q):
        p, q = torch.softmax(p.double(), -1), torch.softmax(q.double(), -1)
        return float((p * torch.log((p + 1e-12) / (q + 1e-12))).sum())

    def loop() -> np.ndarray:
        out = np.zeros((len(exs), L, H))
        with torch.no_grad():
            for e, ex in enumerate(exs):
                ids = torch.tensor([ex.input_ids])
                base = plain(input_ids=ids).logits[0, -1]
                for layer in range(L):
                    q = plain.model.layers[layer].self_attn.q_proj.weight
                    for head in range(H):
                        rows = q[head * D:(head + 1) * D]
                        saved = rows.clone()
                        rows *= eps
                        try:
                            out[e, layer, head] = kl(base, plain(input_ids=ids).logits[0, -1])
                        finally:
                            rows.copy_(saved)
        return out.mean(0)

    ref, t_loop = timed(loop, args.reps)
    diff = float(np.abs(ds["score"].values - ref).max() / np.abs(ref).max())
    return {"headlab": t_batched, "loop": t_loop, "ratio": t_loop / t_batched, "target": 5.0,
            "max_rel_diff": diff}


def composition(args: argparse.Namespace) -> int:
    """The composition comparison against TransformerLens: runs benchmarks/bench_composition.py (TransformerLens in
    its own environment, ``--tl-python``), which prints its own table; its exit status."""
    script = Path(__file__).resolve().with_name("bench_composition.py")
    cmd = [sys.executable, str(script), "--threads", str(args.threads or 1)]
    if args.tl_python:
        cmd += ["--tl-python", args.tl_python]
    return subprocess.run(cmd, check=False).returncode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64, help="ships: rows per forward")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--parts", nargs="+", default=["gradient", "ships", "composition"],
                   choices=["gradient", "ships", "composition"])
    p.add_argument("--tl-python", default=None, help="composition: TransformerLens' interpreter (bench_composition.py)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm, plain = build(args)
    exs = examples(args)
    print(f"random Llama {args.layers} layers x {args.heads} heads (head dim 32, vocabulary 32000), {args.prompts} "
          f"prompts of {args.tokens} tokens, {torch.get_num_threads()} CPU threads, best of {args.reps}")
    if "gradient" in args.parts:
        r = gradient(lm, plain, exs, args)
        print(f"gradient importance: headlab {r['headlab']:.2f}s (one forward + backward)  per-head masking loop "
              f"{r['loop']:.2f}s ({1 + args.layers * args.heads} forwards)  ratio {r['ratio']:.1f}x (target "
              f">= L*H/4 = {r['target']:.0f}x)  Pearson(|gradient|, |masked effect|) {r['pearson']:.2f}")
    if "ships" in args.parts:
        r = ships(lm, plain, exs, args)
        print(f"ships: headlab batched ({args.batch_size} rows per forward) {r['headlab']:.2f}s  reference loop "
              f"(batch 1, {1 + args.layers * args.heads} forwards per prompt) {r['loop']:.2f}s  ratio "
              f"{r['ratio']:.1f}x (target >= 5x)  max relative difference {r['max_rel_diff']:.1e}")
    if "composition" in args.parts:
        print("composition (benchmarks/bench_composition.py):", flush=True)
        if composition(args):
            raise SystemExit("bench_composition.py failed")


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
