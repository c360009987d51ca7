"""Benchmarks of headlab instrumentation on a Llama-shaped random model (never asserted in tests).

    python benchmarks/bench_kernels.py --lengths 1024 4096 8192 16384 [--device cuda] [--pasta-length 8192] [--write]

Per length, side by side (each measurement runs in a fresh subprocess so peak memory is its own):
  1. instrumented forward with an empty plan vs attn_implementation="sdpa" (time ratio);
  2. all-query probes (argmax + span mass, every layer/head/query) vs eager ``output_attentions=True``
     (time and peak memory; eager is skipped above --eager-max or when it fails);
  3. PASTA-style span bias (log alpha on all heads) vs unsteered SDPA at --pasta-length (time, memory).
Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, peak RSS growth (``ru_maxrss``) on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from _common import add_case_options, fmt, memory_base, peak_growth, random_llama, ratio, run_case

LAYERS, HEADS, HEAD_DIM = 4, 8, 64


def build(impl: str, device: str, dtype: str):
    return random_llama(impl, device, dtype, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, vocab=1000)


def measure(case: str, n: int, device: str, dtype: str, reps: int, threads: int = 0) -> dict:
    """Run one case in this process; returns seconds per forward and peak memory growth (bytes)."""

    import torch

    from headlab import instrument as ins

    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    impl = {"sdpa": "sdpa", "eager": "eager"}.get(case, "headlab")
    model = build(impl, device, dtype)
    ids = torch.randint(0, 1000, (1, n), device=device)
    plan = None
    if case == "empty":
        plan = ins.Plan()
    elif case == "probes":
        plan = ins.Plan(probes=ins.Probes(argmax=True, spans=[(0, 16), (n // 2, n // 2 + 64)]))
    elif case == "pasta":
        plan = ins.Plan().bias_keys([(layer, None) for layer in range(LAYERS)],
                                    [(0, n // 2), (n // 2 + 64, n)], math.log(0.01))

    def run():
        with torch.no_grad():
            if plan is None:
                out = model(input_ids=ids, output_attentions=case == "eager", use_cache=False)
            else:
                with ins.instrument(model, plan):
                    out = model(input_ids=ids, use_cache=False)
            if device == "cuda":
                torch.cuda.synchronize()
            return out

    run() if n <= 4096 else None  # warm-up (kernels, allocator) at small sizes
    base = memory_base(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t)
        del out
    return {"seconds": min(times), "peak_bytes": peak_growth(device, base)}


def sub(case, n, args) -> dict:
    cmd = [sys.executable, __file__, "--_case", case, "--lengths", str(n), "--device", args.device,
           "--dtype", args.dtype, "--reps", str(args.reps), "--threads", str(args.threads)]
    return run_case(cmd, args.timeout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--eager-max", type=int, default=8192, help="skip eager above this length")
    p.add_argument("--pasta-length", type=int, default=8192)
    add_case_options(p)
    args = p.parse_args()
    if args._case:
        print(json.dumps(measure(args._case, args.lengths[0], args.device, args.dtype, args.reps, args.threads)))
        return
    print(f"Llama-shaped random model: {LAYERS} layers, {HEADS} heads, head dim {HEAD_DIM}, batch 1, "
          f"{args.device} {args.dtype}, threads={args.threads or 'default'}")
    for n in args.lengths:
        sd = sub("sdpa", n, args)
        em = sub("empty", n, args)
        pr = sub("probes", n, args)
        ea = sub("eager", n, args) if n <= args.eager_max else {"error": f"skipped above {args.eager_max}"}
        print(f"\n== {n} tokens")
        print(f"  sdpa                     {fmt(sd)}")
        print(f"  headlab empty plan       {fmt(em)}   time ratio vs sdpa {ratio(em, sd, 'seconds')}")
        print(f"  headlab probes (argmax+span, all queries) {fmt(pr)}")
        print(f"  eager output_attentions  {fmt(ea)}")
        print(f"  probes vs eager: time {ratio(pr, ea, 'seconds')}, peak memory {ratio(pr, ea, 'peak_bytes')}; "
              f"probes vs sdpa: time {ratio(pr, sd, 'seconds')}")
    if args.pasta_length:
        n = args.pasta_length
        sd = sub("sdpa", n, args)
        pa = sub("pasta", n, args)
        print(f"\n== PASTA span bias on all heads, {n} tokens")
        print(f"  sdpa (unsteered)         {fmt(sd)}")
        print(f"  headlab PASTA            {fmt(pa)}   time {ratio(pa, sd, 'seconds')}, "
              f"peak memory {ratio(pa, sd, 'peak_bytes')}")


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
