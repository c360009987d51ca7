"""PASTA-steered generation: headlab vs unsteered vs the reference's dense 4-D mask (never asserted in tests).

    python benchmarks/bench_pasta.py --lengths 2048 4096 8192 [--new 8] [--dense-max 4096] [--threads 1] [--write]

Per prompt length, each case in a fresh subprocess (so peak memory is its own), greedy generation of
``--new`` tokens, batch 1, on a Llama-shaped random model:

  1. ``plain``: unsteered generation (headlab attention with no plan = transformers' SDPA call);
  2. ``pasta``: headlab's ``pasta`` plugin (log(alpha) key-span biases through the kernels' SDPA path, the
     bias folded into an extra head-dim coordinate), on ``--heads-per-layer`` heads of every layer;
  3. ``dense``: the reference implementation's mechanism (pastalib ``edit_multisection_attention``): eager
     attention with a forward pre-hook per steered layer that clones the 4-D additive mask, expands it to
     (batch, heads, queries, keys) and adds log(alpha) to the non-emphasised prompt columns of the steered
     heads, on every forward.

The emphasised span is 64 tokens in the middle of the prompt. Peak memory: ``torch.cuda.max_memory_allocated``
growth on CUDA, peak RSS growth (``ru_maxrss``) on CPU. The script also reports whether ``pasta`` and
``dense`` generated the same tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from _common import add_case_options, memory_base, peak_growth, random_llama, ratio, run_case
from _common import fmt as _fmt

LAYERS, HEADS, HEAD_DIM, VOCAB = 4, 8, 64, 1000


def build(impl: str, device: str, dtype: str):
    m = random_llama(impl, device, dtype, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, vocab=VOCAB,
                     initializer_range=0.1)
    m.generation_config.eos_token_id = None
    return m


def dense_hooks(model, heads: list[tuple[int, int]], emph: tuple[int, int], n_prompt: int, alpha: float):
    """The reference's pre-hooks: expand + clone the 4-D mask and add log(alpha) per steered head."""
    handles = []
    scale = math.log(alpha)
    for layer in sorted({ly for ly, _ in heads}):
        head_idx = [h for ly, h in heads if ly == layer]

        def pre(mod, args, kwargs, head_idx=head_idx):
            mask = kwargs["attention_mask"]
            bsz, hd, tgt, src = mask.shape
            if hd != HEADS:
                mask = mask.expand(bsz, HEADS, tgt, src).clone()
            ti, tj = emph
            for bi in range(bsz):
                mask[bi, head_idx, :, :ti] += scale
                mask[bi, head_idx, :, tj:n_prompt] += scale
            kwargs["attention_mask"] = mask
            return args, kwargs

        handles.append(model.model.layers[layer].self_attn.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


def measure(case: str, n: int, new: int, device: str, dtype: str, heads_per_layer: int, threads: int) -> dict:
    """Run one case in this process: seconds for the whole generation, peak memory growth, tokens."""

    import torch

    from headlab.context import Example
    from headlab.generation import Batch, DecodeRequest, decode_loop
    from headlab.instrument import Plan
    from headlab.model import LoadedModel, geometry_of
    from headlab.plugins.steering.pasta import apply_pasta

    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    model = build("eager" if case == "dense" else "headlab", device, dtype)
    lm = LoadedModel(model=model, tokenizer=None, name="bench", geometry=geometry_of(model), device=device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (1, n), generator=g).to(device)
    batch = Batch(ids, torch.ones_like(ids), [[(0, 0)] * n], [0], [Example(prompt="")])
    emph = (n // 2, n // 2 + 64)
    heads = [(ly, h) for ly in range(LAYERS) for h in range(heads_per_layer)]
    alpha = 0.01

    def run():
        plan, handles = None, []
        if case == "pasta":
            plan = Plan()
            apply_pasta(plan, heads, [[emph]], [(0, n)], alpha, "exclude")
        elif case == "dense":
            handles = dense_hooks(model, heads, emph, n, alpha)
        try:
            req = DecodeRequest(lm, batch, new, [], plan, 0)
            out = decode_loop(req, lambda o, _: o.logits[:, -1].argmax(-1))
        finally:
            for h in handles:
                h.remove()
        if device == "cuda":
            torch.cuda.synchronize()
        return out.tokens[0]

    if device == "cuda":
        run()  # warm-up (kernel compilation, allocator)
    base = memory_base(device)
    t = time.perf_counter()
    tokens = run()
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "peak_bytes": peak_growth(device, base), "tokens": tokens}


def sub(case: str, n: int, args) -> dict:
    cmd = [sys.executable, __file__, "--_case", case, "--lengths", str(n), "--new", str(args.new), "--device",
           args.device, "--dtype", args.dtype, "--threads", str(args.threads), "--heads-per-layer",
           str(args.heads_per_layer)]
    return run_case(cmd, args.timeout, killed="killed (out of memory?)")


def fmt(r: dict) -> str:
    return _fmt(r, "{:.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--new", type=int, default=8, help="tokens generated per prompt")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--heads-per-layer", type=int, default=4, help="steered heads in every layer")
    p.add_argument("--dense-max", type=int, default=8192, help="skip the dense-mask case above this length")
    add_case_options(p)
    args = p.parse_args()
    if args._case:
        print(json.dumps(measure(args._case, args.lengths[0], args.new, args.device, args.dtype,
                                 args.heads_per_layer, args.threads)))
        return
    print(f"Llama-shaped random model: {LAYERS} layers, {HEADS} heads, head dim {HEAD_DIM}; PASTA on "
          f"{args.heads_per_layer} heads x {LAYERS} layers, alpha 0.01, 64-token emphasis; batch 1, "
          f"{args.new} new tokens, {args.device} {args.dtype}, threads={args.threads or 'default'}")
    for n in args.lengths:
        plain = sub("plain", n, args)
        pasta = sub("pasta", n, args)
        dense = sub("dense", n, args) if n <= args.dense_max else {"error": f"skipped above {args.dense_max}"}
        same = "n/a" if "error" in pasta or "error" in dense else str(pasta["tokens"] == dense["tokens"])
        print(f"\n== {n} prompt tokens")
        print(f"  unsteered (SDPA)            {fmt(plain)}")
        print(f"  headlab pasta               {fmt(pasta)}   vs unsteered: time {ratio(pasta, plain, 'seconds')}, "
              f"memory {ratio(pasta, plain, 'peak_bytes')}")
        print(f"  dense 4-D mask, eager       {fmt(dense)}   headlab/dense: time {ratio(pasta, dense, 'seconds')}, "
              f"memory {ratio(pasta, dense, 'peak_bytes')}; same tokens: {same}")


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
