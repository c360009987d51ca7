"""Probe selection for all heads: headlab's ``probe`` detector vs an honest_llama-style loop, side by side.

    python benchmarks/bench_probes.py [--prompts 1000] [--layers 8] [--hidden 256] [--heads 8] [--folds 2] [--write]
        [--batch-size 32] [--n-jobs -1] [--solver lbfgs] [--vocab 32000] [--threads 0] [--device cpu]

One random Llama (seeded weights, ``--layers`` layers, a ``--vocab`` vocabulary, Llama's 32,000 by default; the
embedded model's tokenizer) and ``--prompts`` labelled prompts of 12 to 40 random words, half of them holding a
marker word (the label), two prompts per group. The folds are the same for both (``StratifiedGroupKFold``, seed 0). Timed, after one untimed warm-up prompt each:

- ``headlab``: the ``probe`` detector (``classifier: logistic``): ``--batch-size`` prompts of similar length
  per forward through headlab's attention recording ``z`` of every head at the last token, then one sklearn
  ``LogisticRegression`` (``--solver``) per head and fold over joblib worker processes (``--n-jobs``), plus its refit on all examples
  per head (the probe direction) and the mass-mean directions and sigma;
- ``reference``: what likenneth/honest_llama does: one prompt per forward of the model with eager attention,
  a forward pre-hook on every ``o_proj`` keeping its input at the last token (baukit's ``TraceDict`` with
  ``retain_input``), then ``for layer: for head: for fold: LogisticRegression(max_iter=1000).fit`` in Python.

Prints the seconds of each, the ratio, on a CPU the ceiling (the largest ratio the layer arithmetic that the
features need allows at this machine's measured matmul rate), and the largest difference between the two methods' per-head mean
held-out accuracies (they fit the same classifiers on the same features, up to float rounding).
"""

from __future__ import annotations

import argparse
import copy
import random
import time


def build(args):
    import torch
    from transformers import AutoModelForCausalLM

    from headlab import Example
    from headlab.model import load_model
    from headlab.spec import ModelSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    config = {"model_type": "llama", "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": args.heads, "num_key_value_heads": args.heads,
              "intermediate_size": 2 * args.hidden, "vocab_size": args.vocab, "max_position_embeddings": 256,
              "tokenizer": "headlab-tiny"}
    torch.manual_seed(0)
    lm = load_model(ModelSpec(config=config, device=args.device))
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(lm.model.config), attn_implementation="eager")
    eager.load_state_dict(lm.model.state_dict())
    eager = eager.to(lm.model.device).eval()
    words = sorted(w for w in lm.tokenizer.get_vocab() if w.isalpha() and w.islower() and len(w) > 2)[:200]
    marker, words = words[0], words[1:]
    rng = random.Random(0)
    examples = []
    for i in range(args.prompts):
        text = [rng.choice(words) for _ in range(rng.randint(12, 40))]
        if i % 2:
            text[rng.randrange(len(text) - 2)] = marker
        examples.append(Example(prompt=" ".join(text), meta={"truth": bool(i % 2), "group": i // 4}))
    return lm, eager, examples


def reference(lm, eager, examples, fold, y, n_folds):
    """honest_llama's loop: batch 1 with eager attention and o_proj input hooks, one fit per head and fold;
    returns the accuracies and the seconds of the forwards."""
    import numpy as np
    import torch
    from sklearn.linear_model import LogisticRegression

    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    kept = {}
    handles = [layer.self_attn.o_proj.register_forward_pre_hook(
        lambda m, args, i=i: kept.__setitem__(i, args[0][0, -1].detach().float().cpu()))
        for i, layer in enumerate(eager.model.layers)]
    feats = []
    t0 = time.perf_counter()
    try:
        for ex in examples:
            ids = lm.tokenizer(ex.prompt, return_tensors="pt").input_ids.to(eager.device)
            with torch.no_grad():
                eager(input_ids=ids)
            feats.append(torch.stack([kept[i] for i in range(L)]).reshape(L, H, -1).numpy())
    finally:
        for h in handles:
            h.remove()
    z = np.stack(feats).astype(np.float64)
    t_forwards = time.perf_counter() - t0
    acc = np.zeros((L, H))
    for layer in range(L):
        for head in range(H):
            accs = []
            for k in range(n_folds):
                tr, te = fold != k, fold == k
                clf = LogisticRegression(max_iter=1000).fit(z[tr, layer, head], y[tr])
                accs.append((clf.predict(z[te, layer, head]) == y[te]).mean())
            acc[layer, head] = np.mean(accs) if accs else np.nan
    return acc, t_forwards


def headlab_forwards(lm, examples, batch_size: int) -> float:
    """Seconds of the probe detector's forwards alone (tokenize, one forward per batch, z at the last token)."""
    from headlab import tokenize
    from headlab.plugins.probes.probe import collect_z, length_batches

    t0 = time.perf_counter()
    for idx in length_batches(lm, examples, batch_size):
        collect_z(lm, tokenize(lm, [examples[i] for i in idx]), "last")
    return time.perf_counter() - t0


def ceiling(lm, examples, intermediate: int, t_ref: float) -> str | None:
    """On a CPU, the largest ratio any exact method could reach against the loop's ``t_ref`` seconds: the
    layer arithmetic that z at the last token needs (every layer's projections and MLP at every token, except
    the last layer's query, o_proj and MLP) at the best matmul rate this machine gives now."""
    import torch

    if lm.model.device.type != "cpu":
        return None
    geo = lm.geometry
    hidden, kv = geo.n_heads * geo.head_dim, geo.n_kv_heads * geo.head_dim
    tokens = sum(len(lm.tokenizer(ex.prompt).input_ids) for ex in examples)
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate  # q, o; k, v; gate, up, down
    flops = 2 * tokens * ((geo.n_layers - 1) * per_layer + 2 * hidden * kv)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(30):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    rate = 2 * 1024**3 / best
    floor = flops / rate
    return (f"ceiling on this CPU: z at the last token needs {flops / 1e9:.0f} GFLOP of layer arithmetic "
            f"({tokens} tokens); at the best matmul rate measured now ({rate / 1e9:.0f} GFLOP/s, torch.mm "
            f"1024x1024, {torch.get_num_threads()} threads) that is {floor:.2f} s, so no exact method reaches more "
            f"than {t_ref / floor:.1f}x against the loop's {t_ref:.2f} s")


def sdpa_forwards(lm, examples, batch_size: int) -> float:
    """Seconds of transformers' own SDPA forward of the same batches (logits at the last position, nothing
    recorded): what a plain forward of the model costs, the floor of any method built on it."""
    import torch
    from transformers import AutoModelForCausalLM

    from headlab import tokenize
    from headlab.plugins.probes.probe import length_batches

    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(lm.model.config), attn_implementation="sdpa")
    sdpa.load_state_dict(lm.model.state_dict())
    sdpa = sdpa.to(lm.model.device).eval()
    batches = [tokenize(lm, [examples[i] for i in idx]) for idx in length_batches(lm, examples, batch_size)]
    t0 = time.perf_counter()
    with torch.no_grad():
        for b in batches:
            sdpa(input_ids=b.input_ids, attention_mask=b.attention_mask, logits_to_keep=1)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000,
                    help="the model's vocabulary (Llama's 32,000; the prompts use the embedded tokenizer's ids)")
    ap.add_argument("--folds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--n-jobs", type=int, default=-1)
    ap.add_argument("--solver", default="lbfgs", choices=["lbfgs", "newton-cholesky"],
                    help="the probe detector's solver (the loop always runs sklearn's default, lbfgs)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    import numpy as np
    import torch

    from headlab import StepContext
    from headlab.plugins.probes.probe import Probe, detect, folds_of

    lm, eager, examples = build(args)
    y = np.array([int(ex.meta["truth"]) for ex in examples])
    fold = folds_of(y, [ex.meta["group"] for ex in examples], args.folds, 0)
    config = Probe(label="truth", group="group", folds=args.folds, seed=0, batch_size=args.batch_size,
                   n_jobs=args.n_jobs, solver=args.solver)
    sync = torch.cuda.synchronize if lm.model.device.type == "cuda" else (lambda: None)

    warm = examples[:8]
    detect(config.model_copy(update={"folds": 2}), StepContext(model=lm, examples=warm, results={}, seed=0))
    reference(lm, eager, warm[:1], np.array([0]), np.array([0]), 0)

    sync()
    t0 = time.perf_counter()
    ds = detect(config, StepContext(model=lm, examples=examples, results={}, seed=0))
    sync()
    t_headlab = time.perf_counter() - t0
    assert np.array_equal(ds["fold"].values, fold)

    t0 = time.perf_counter()
    ref, t_ref_forwards = reference(lm, eager, examples, fold, y, args.folds)
    sync()
    t_ref = time.perf_counter() - t0
    t_forwards = headlab_forwards(lm, examples, args.batch_size)
    sync()
    t_sdpa = sdpa_forwards(lm, examples, args.batch_size)
    sync()

    geo = lm.geometry
    print(f"model: random llama, {geo.n_layers} layers x {geo.n_heads} heads, head_dim {geo.head_dim}, "
          f"hidden {args.hidden}, vocabulary {args.vocab}; {len(examples)} prompts, {args.folds} folds; device {lm.model.device}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"headlab probe:           {t_headlab:8.2f} s  ({ds.attrs['forwards']} forwards of {args.batch_size}: "
          f"{t_forwards:.2f} s (timed again alone); {ds.attrs['fits']} fits and the rest: "
          f"{t_headlab - t_forwards:.2f} s, n_jobs {args.n_jobs}, solver {args.solver})")
    print(f"honest_llama-style loop: {t_ref:8.2f} s  ({len(examples)} forwards of 1: {t_ref_forwards:.2f} s; "
          f"{geo.n_layers * geo.n_heads * args.folds} fits: {t_ref - t_ref_forwards:.2f} s)")
    print(f"ratio: {t_ref / t_headlab:.1f}x overall; forwards alone {t_ref_forwards / t_forwards:.1f}x "
          "(phases timed in separate runs: on a busy machine they need not add up)")
    print(f"transformers' own SDPA forward of the same batches, nothing recorded: {t_sdpa:.2f} s "
          f"(headlab's forwards cost {t_forwards / t_sdpa:.2f}x it; the loop's forwards {t_ref_forwards / t_sdpa:.1f}x)")
    bound = ceiling(lm, examples, 2 * args.hidden, t_ref)
    if bound:
        print(bound)
    diff = np.abs(ds["score"].values - ref).max()
    print(f"per-head accuracy: largest difference {diff:.4f}; best head {ds['score'].values.max():.3f} "
          f"(reference {ref.max():.3f}); mean {ds['score'].values.mean():.3f} (reference {ref.mean():.3f})")


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
