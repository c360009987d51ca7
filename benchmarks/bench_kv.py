"""KV bytes, peak memory and decode speed of head-level KV-cache policies after long prompts: today's full
cache, headlab's ``streaming`` (a headwise cache that stores sinks + a window for the compressed KV heads) and
kvpress's ``DuoAttentionPress`` with the same head mask, side by side in one run.

    python benchmarks/bench_kv.py [--lengths 8192 16384 32768] [--new 64] [--device cpu|cuda] [--dtype float32] [--write]
        [--layers 8] [--hidden 512] [--heads 8] [--kv-heads 2] [--full-fraction 0.25] [--sink 4] [--window 256]
        [--threads 1] [--prefill-chunk 0] [--kvpress-python .venv-kvpress/bin/python] [--live-new 4]
        [--malloc-mmap-threshold BYTES]

Model: a seeded random-weight Llama with GQA (``--layers`` x ``--heads`` query heads over ``--kv-heads`` KV
heads, hidden ``--hidden``, vocabulary 1024); a fixed random ``--full-fraction`` of its KV heads are full (the
same mask for every case, drawn with numpy's generator seeded 0), every other KV head keeps ``--sink`` + ``--window``
tokens. Per prompt length and case, in a fresh subprocess (so the peak memory is its own): one prefill
forward of a batch-1 random prompt (logits of the last token only), then ``--new`` greedy decode steps. Reported:

- KV bytes held after the decode (keys and values; kvpress's cache keeps every token by its design: it
  overwrites dropped keys with a fake key);
- the peak memory growth over the case (CPU: peak resident set size over the process's size after loading the
  model; CUDA: ``max_memory_allocated`` over the allocated memory before the prefill);
- on a CPU, also the **live-tensor peak**: the most bytes of tensor storage created during the case and alive at
  once (``headlab.kv.kv_policy(..., cpu_peak=True)``; for ``full`` and ``kvpress`` under a map of every KV head
  full, which only measures), the CPU analogue of CUDA's ``max_memory_allocated``, without what the process's
  allocator holds beyond live tensors. Its operator tracking slows decode steps down, so it runs in a second
  process per case (the same prefill, then ``--live-new`` decode steps; 0 skips it), and the timings and the
  peak RSS come from the first, unmeasured one. ``kvpress``'s needs headlab importable in kvpress's environment
  (installed there ``--no-deps`` with its other dependencies), else its column says why it is missing;
- the decode's own peak growth: the peak over the decode steps above what was in use after the prefill
  (CUDA: allocated memory; CPU: resident set size, its peak reset after the prefill through
  ``/proc/self/clear_refs``; not reported where the kernel refuses that reset);
- the peak the kept bytes predict for a case: ``full``'s peak - ``full``'s KV bytes + the case's KV bytes
  (what the peak would be if the case differed from ``full`` by its cache alone), and the measured peak over
  it (``peak / predicted``; 1.00x for ``full`` by definition, and above 1 where a case holds more transient
  memory than ``full``), for each measure (the live one predicted from its own pass's KV bytes);
- prefill seconds and decode tokens/s (``--new`` / the decode's wall time).

Cases: ``full`` (transformers' SDPA attention, ``DynamicCache``), ``streaming`` (headlab's attention under
``headlab.kv.kv_policy``), ``kvpress`` (SDPA patched by kvpress, in kvpress's own virtual environment,
``--kvpress-python``; skipped, with the reason, when that interpreter or kvpress is missing).

The allocator: on a CPU the peak RSS counts what glibc's malloc keeps of freed blocks. By default its mmap
threshold is dynamic (freeing a block that was mmapped raises it to that block's size, up to 32 MiB), so after
the first large free, blocks of up to that size come from the heap, whose freed space is reused but not
returned to the system while a later block lies above it. ``--malloc-mmap-threshold BYTES`` sets
``MALLOC_MMAP_THRESHOLD_`` in every case's process alike (a fixed threshold: every block of at least BYTES is
mmapped and unmapped when freed), and the header line names the allocator settings in force (``MALLOC_*`` and
``GLIBC_TUNABLES`` from the environment are passed on to every case too). The peak RSS is then close to the
live-tensor peak, but every large block costs fresh page faults: the times under it are not those of the default.

Targets (issue [kv-heads]): at 32K, headlab's KV bytes <= 0.3x full, its peak within 10% of what its kept bytes
predict (``peak / predicted <= 1.10``) and decode tokens/s >= 2x full; prefill no slower than full.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_case_options, memory_base, peak_growth, ratio, run_case  # noqa: E402

CASES = ("full", "streaming", "kvpress")


def head_mask(layers: int, kv_heads: int, fraction: float):
    """The full KV heads: ``round(fraction * layers * kv_heads)`` of them drawn by numpy's generator seeded 0
    (a numpy bool array ``(layers, kv_heads)``; the same in every environment)."""
    import numpy as np

    n = layers * kv_heads
    full = np.zeros(n, dtype=bool)
    full[np.random.default_rng(0).choice(n, size=round(fraction * n), replace=False)] = True
    return full.reshape(layers, kv_heads)


def build_model(args: argparse.Namespace, impl: str):
    """The seeded random GQA Llama of ``args`` with attention ``impl``."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=1024,
        max_position_embeddings=max(65536, 2 * args.length))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl, dtype=getattr(torch, args.dtype))
    return model.eval().to(args.device)


def _cache_bytes(cache) -> int:
    """Bytes of keys and values a transformers cache holds (a ``HeadwiseCache`` counts its own)."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    return sum(int(t.numel() * t.element_size()) for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None and hasattr(t, "numel"))


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _rss() -> int:
    """The process's resident set size now, in bytes."""
    import os

    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_rss_peak() -> bool:
    """Reset the process's peak resident set size to its current size (Linux ``clear_refs``); False when refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _rss_peak() -> int:
    """The process's peak resident set size since it started or since the last reset, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def decode(model, ids, new: int, device: str, prefill_context=None, cache=None, chunk: int = 0) -> dict:
    """One prefill forward on ``ids`` (inside ``prefill_context`` when given, starting from ``cache``; with
    ``chunk``, forwards of at most ``chunk`` tokens into a ``DynamicCache``) and ``new`` greedy steps; the
    times, the bytes the cache holds at the end and the peak memory growth."""
    import contextlib

    import torch

    base = memory_base(device)
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        with prefill_context or contextlib.nullcontext():
            if chunk:
                import transformers

                cache = transformers.DynamicCache() if cache is None else cache
                for start in range(0, ids.shape[1], chunk):
                    out = model(input_ids=ids[:, start:start + chunk], past_key_values=cache, use_cache=True,
                                logits_to_keep=1)
                    cache = out.past_key_values
            else:
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        _sync(device)
        prefill = time.perf_counter() - t0
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        if device == "cuda":
            prefill_peak = torch.cuda.max_memory_allocated() - base
            after_prefill = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            prefill_peak = peak_growth(device, base)
            after_prefill = _rss()
            reset = _reset_rss_peak()
        t0 = time.perf_counter()
        for _ in range(new):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
        _sync(device)
        seconds = time.perf_counter() - t0
    result = {"prefill_s": prefill, "decode_s": seconds, "tokens_per_s": new / seconds,
              "kv_bytes": _cache_bytes(cache)}
    if device == "cuda":
        decode_peak = torch.cuda.max_memory_allocated()
    elif reset:
        decode_peak = _rss_peak()
    else:
        result["peak_bytes"] = peak_growth(device, base)
        return result
    result["decode_peak_bytes"] = max(0, decode_peak - after_prefill)
    result["peak_bytes"] = max(0, prefill_peak, decode_peak - base)
    return result


def _live_peak(model, mask, args: argparse.Namespace, run):
    """``run()`` (a :func:`decode`) inside ``headlab.kv.kv_policy(..., cpu_peak=True)`` with a map of every KV
    head full (the model's own cache, only measured); its result with the live-tensor peak (``live_peak_bytes``)."""
    import numpy as np
    import xarray as xr

    from headlab.kv import HeadMap, kv_policy

    every = HeadMap(xr.DataArray(np.ones_like(mask), dims=("layer", "kv_head")), attrs={"policy": "full"})
    with kv_policy(model, every, cpu_peak=True) as usage:
        result = run()
    return {**result, "live_peak_bytes": usage.peak_memory}


def measure(args: argparse.Namespace) -> dict:
    """One case at one length (run in a subprocess of this script); with ``--_live``, the live-tensor peak
    instead of the timings (``live_peak_bytes``, and the KV bytes of that pass)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    ids = torch.randint(3, 1024, (1, args.length), generator=torch.Generator().manual_seed(1)).to(args.device)
    mask = head_mask(args.layers, args.kv_heads, args.full_fraction)
    if args._case == "full":
        model = build_model(args, "sdpa")
        run = lambda: decode(model, ids, args.new, args.device, chunk=args.prefill_chunk)  # noqa: E731
        return _live_peak(model, mask, args, run) if args._live else run()
    if args._case == "streaming":
        import xarray as xr

        from headlab import instrument
        from headlab.kv import HeadMap, kv_policy

        instrument.register()
        model = build_model(args, "headlab")
        head_map = HeadMap(xr.DataArray(mask, dims=("layer", "kv_head")), sink=args.sink, window=args.window,
                           attrs={"policy": "streaming"})
        with kv_policy(model, head_map, prefill_chunk=args.prefill_chunk or None, cpu_peak=args._live) as usage:
            result = decode(model, ids, args.new, args.device)
        return {**result, "live_peak_bytes": usage.peak_memory} if args._live else result
    if args._case == "kvpress":
        from kvpress import DuoAttentionPress

        class FixedMaskDuo(DuoAttentionPress):
            """DuoAttention's press with a given streaming mask (kvpress loads masks of 6 checkpoints only)."""

            def post_init_from_model(self, model):
                pass

        import transformers

        model = build_model(args, "sdpa")
        press = FixedMaskDuo(head_compression_ratio=1 - args.full_fraction)
        press.sink_size, press.recent_size = args.sink, args.window
        press.streaming_mask = torch.from_numpy(~mask).to(args.device)
        run = lambda: decode(model, ids, args.new, args.device, prefill_context=press(model),  # noqa: E731
                             cache=transformers.DynamicCache())
        return _live_peak(model, mask, args, run) if args._live else run()
    raise ValueError(args._case)


def predicted_bytes(args: argparse.Namespace, length: int) -> tuple[int, int]:
    """(full, streaming) KV bytes after ``length + new`` tokens by the cache's formula (batch 1, no padding)."""
    import numpy as np

    item = {"float32": 4, "float16": 2, "bfloat16": 2}[args.dtype]
    head_dim = args.hidden // args.heads
    n = length + args.new
    n_full = int(head_mask(args.layers, args.kv_heads, args.full_fraction).sum())
    n_comp = args.layers * args.kv_heads - n_full
    kept = min(args.sink, n) + min(args.window, max(0, n - args.sink))
    full = 2 * args.layers * args.kv_heads * n * head_dim * item
    stream = 2 * (n_full * n + n_comp * kept) * head_dim * item
    return int(full), int(np.int64(stream))


def predicted_peak(case: dict, full: dict, peak: str = "peak_bytes", kv: str = "kv_bytes") -> float | None:
    """The peak memory growth ``case``'s kept bytes predict: ``full``'s peak - ``full``'s KV bytes + the case's KV
    bytes, read under the keys ``peak`` and ``kv`` (None without both measurements, or when that is not
    positive)."""
    if "error" in case or "error" in full or peak not in full or kv not in full or kv not in case:
        return None
    pred = full[peak] - full[kv] + case[kv]
    return pred if pred > 0 else None


def peak_cells(case: dict, full: dict, peak: str, kv: str) -> str:
    """The table cells ``peak MiB, predicted MiB, peak / predicted`` of one measure (``n/a`` where missing)."""
    if "error" in case or peak not in case:
        return f"{'n/a':>9} {'n/a':>10} {'n/a':>6}"
    pred = predicted_peak(case, full, peak, kv)
    cells = f"{case[peak] / 2**20:>9.1f} "
    return cells + (f"{pred / 2**20:>10.1f} {case[peak] / pred:>5.2f}x" if pred else f"{'n/a':>10} {'n/a':>6}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768], help="prompt tokens")
    p.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--new", type=int, default=64, help="decoded tokens")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--full-fraction", type=float, default=0.25, help="fraction of KV heads kept full")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prefill full and streaming in forwards of at most this many tokens (0: one forward; "
                        "kvpress always prefills in one, as its press compresses after that forward)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--live-new", type=int, default=4,
                   help="CPU: decoded tokens of each case's second process, which measures the live-tensor peak "
                        "(0: no such process)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="glibc malloc: serve blocks of at least BYTES by mmap (returned to the system when freed) "
                        "in every case's process (MALLOC_MMAP_THRESHOLD_; default: glibc's dynamic threshold)")
    p.add_argument("--_live", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kvpress-python", default=str(ROOT / ".venv-kvpress" / "bin" / "python"),
                   help="the interpreter of kvpress's virtual environment")
    add_case_options(p)
    args = p.parse_args()
    if args._case:
        print(json.dumps(measure(args)))
        return

    mask = head_mask(args.layers, args.kv_heads, args.full_fraction)
    print(f"random Llama: {args.layers} layers, {args.heads} heads over {args.kv_heads} KV heads, hidden "
          f"{args.hidden}, {args.dtype} on {args.device}; {int(mask.sum())} of {mask.size} KV heads full "
          f"({[tuple(map(int, x)) for x in zip(*mask.nonzero(), strict=True)]}), sink {args.sink}, window "
          f"{args.window}; {args.new} decoded tokens")
    kvpress_ok = Path(args.kvpress_python).is_file()
    if kvpress_ok:
        check = subprocess.run([args.kvpress_python, "-c", "import kvpress"], capture_output=True, text=True)
        kvpress_ok = check.returncode == 0
        reason = (check.stderr.strip().splitlines() or ["import failed"])[-1]
    else:
        reason = f"no interpreter at {args.kvpress_python} (python3 -m venv .venv-kvpress && " \
                 ".venv-kvpress/bin/pip install kvpress torch==2.13.0)"
    if "kvpress" in args.cases and not kvpress_ok:
        print(f"kvpress: skipped ({reason})")
    if args.malloc_mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    tunables = [f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("MALLOC_")
                or k == "GLIBC_TUNABLES"]
    print(f"allocator: glibc malloc, {', '.join(tunables) or 'default thresholds'} (every case's process)"
          if args.device == "cpu" else "allocator: torch's CUDA caching allocator")
    live = args.device == "cpu" and args.live_new > 0
    forwarded = ["--new", str(args.new), "--device", args.device, "--dtype", args.dtype, "--layers",
                 str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads), "--kv-heads",
                 str(args.kv_heads), "--full-fraction", str(args.full_fraction), "--sink", str(args.sink),
                 "--window", str(args.window), "--threads", str(args.threads), "--prefill-chunk",
                 str(args.prefill_chunk)]
    for length in args.lengths:
        results = {}
        for case in args.cases:
            if case == "kvpress" and not kvpress_ok:
                results[case] = {"error": "skipped"}
                continue
            python = args.kvpress_python if case == "kvpress" else sys.executable
            cmd = [python, __file__, "--_case", case, "--length", str(length), *forwarded]
            results[case] = run_case(cmd, args.timeout)
            if live and "error" not in results[case]:
                cmd[cmd.index("--new") + 1] = str(args.live_new)
                r = run_case([*cmd, "--_live"], args.timeout)
                results[case].update({"live_error": r["error"]} if "error" in r else
                                     {"live_peak_bytes": r["live_peak_bytes"], "live_kv_bytes": r["kv_bytes"]})
        full_pred, stream_pred = predicted_bytes(args, length)
        print(f"\nprompt {length} tokens (formula: full KV {full_pred / 2**20:.1f} MiB, streaming "
              f"{stream_pred / 2**20:.1f} MiB, {stream_pred / full_pred:.3f}x)")
        full = results.get("full", {"error": "not run"})
        measure_name = "peak RSS" if args.device == "cpu" else "peak alloc"
        print(f"{'case':<10} {'KV MiB':>9} {measure_name:>9} {'predicted':>10} {'/pred':>6} "
              + (f"{'live peak':>9} {'predicted':>10} {'/pred':>6} " if live else "")
              + f"{'decode pk':>10} {'prefill s':>10} {'decode tok/s':>13}")
        for case, r in results.items():
            if "error" in r:
                print(f"{case:<10} FAILED/SKIPPED ({r['error']})")
                continue
            print(f"{case:<10} {r['kv_bytes'] / 2**20:>9.1f} {peak_cells(r, full, 'peak_bytes', 'kv_bytes')} "
                  + (f"{peak_cells(r, full, 'live_peak_bytes', 'live_kv_bytes')} " if live else "")
                  + (f"{r['decode_peak_bytes'] / 2**20:>10.1f} " if "decode_peak_bytes" in r else f"{'n/a':>10} ")
                  + f"{r['prefill_s']:>10.2f} {r['tokens_per_s']:>13.1f}")
        if live:
            for case, r in results.items():
                if "live_error" in r:
                    print(f"{case} live peak: n/a ({r['live_error']})")
            print(f"(live peak: tensor bytes alive at once, headlab.kv.kv_policy(..., cpu_peak=True), in a second "
                  f"process per case with {args.live_new} decoded tokens; its prediction uses that pass's KV bytes)")
        for case in ("streaming", "kvpress"):
            if case in results:
                r = results[case]
                print(f"{case} / full: KV bytes {ratio(r, full, 'kv_bytes')}, peak {ratio(r, full, 'peak_bytes')}, "
                      f"prefill time {ratio(r, full, 'prefill_s')}, decode tokens/s {ratio(r, full, 'tokens_per_s')}")
        r = results.get("streaming", {"error": ""})
        if "error" not in r:
            print(f"streaming KV bytes vs the formula: {r['kv_bytes'] / stream_pred:.3f}x")


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
