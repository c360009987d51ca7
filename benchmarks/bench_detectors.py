"""Induction-head detection at long context: headlab vs a plain SDPA forward vs TransformerLens (not a test).

    python benchmarks/bench_detectors.py --lengths 1024 2048 4096 8192 16384 32768 --threads 1 [--write] \
        [--tl-python .venv-tl/bin/python] [--reps 3] [--checkpoint /tmp/headlab-bench-llama]

One random Llama checkpoint (4 layers x 8 heads x head dim 64, hidden 512, vocabulary 32000, seeded) is
built locally and saved once (``--checkpoint``; no weights are downloaded); every tool loads it from disk.
The input is the induction probe ``BOS + r + r`` with ``r`` random tokens (``len(r) = n / 2``, so ``n + 1``
tokens). Per length, each tool runs in a fresh process (its peak memory is its own):

- ``sdpa``: the model loaded with ``attn_implementation="sdpa"``, one plain forward (``use_cache=False``);
- ``sdpa-last``: the same forward keeping only the last position's logits (``logits_to_keep=1``), as the
  detector runs it: the cost of the attention and MLP layers alone;
- ``headlab``: the ``induction`` detector (``headlab.plugins.detectors.patterns``, defaults: ``mul``, pair
  probes) called from Python on the example, as a notebook would: detection pairs, one instrumented
  forward, scores;
- ``tl``: TransformerLens ``head_detector.detect_head(model, seq, "induction_head")`` on a
  ``TransformerBridge.boot_transformers(checkpoint)`` of the same checkpoint, fed the same tokens (its
  ``to_tokens`` returns them): ``run_with_cache`` plus TL's dense detection matrices. TransformerLens runs
  in its own interpreter (``--tl-python``: a separate virtual environment, so the main one keeps its torch
  and transformers); skipped when absent.

A tool is skipped where its predicted peak exceeds ``--mem-limit-gib`` (default: 90% of the memory
available when the benchmark starts). Time: the median of ``--reps`` runs in one process (load excluded),
wall clock and the process's CPU time (less sensitive to other processes on a shared machine);
peak memory: growth of the peak RSS over the RSS after loading (CPU), ``max_memory_allocated`` on CUDA.
headlab and TL write their (layer, head) scores; the table shows the largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import mem_available, memory_base, peak_growth, ratio, run_case  # noqa: E402

LAYERS, HEADS, HEAD_DIM, HIDDEN, VOCAB = 4, 8, 64, 512, 32000
TOOLS = ("sdpa", "sdpa-last", "headlab", "tl")


def build_checkpoint(path: Path) -> None:
    """Save the seeded random Llama and a word-level tokenizer (``t3 .. t31999``) to ``path``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                                   vocab_size=VOCAB, max_position_embeddings=65536, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)


def tokens(n: int) -> list[int]:
    """``BOS + r + r`` with ``len(r) = n // 2`` seeded random tokens."""
    import random

    rng = random.Random(n)
    seg = [rng.randrange(3, VOCAB) for _ in range(n // 2)]
    return [1] + seg + seg


def predicted_bytes(tool: str, n: int) -> float:
    """A rough peak for the tool at ``n + 1`` tokens (float32), to skip what cannot fit."""
    n = n + 1
    act = 12 * n * HIDDEN * 4 + 2 * n * 2 * HIDDEN * 4  # hidden states, q/k/v, MLP
    if tool == "sdpa":
        return act + n * VOCAB * 4  # + the logits
    if tool == "sdpa-last":
        return act
    if tool == "headlab":
        return act + HEADS * 128 * n * 4 * 3 + 64 * n * 4 * 2  # + a query block of scores, probes, pairs
    # TL: cached attention scores and pattern of every layer, the forward's own, dense int64 detection matrices
    return 2 * LAYERS * HEADS * n * n * 4 + 2 * HEADS * n * n * 4 + 4 * n * n * 8 + n * VOCAB * 4 + act


def measure(tool: str, n: int, checkpoint: str, reps: int, threads: int, device: str, scores_out: str) -> dict:
    """Run one tool in this process; returns seconds (median), peak growth and what ran."""

    import numpy as np
    import torch

    if threads:
        torch.set_num_threads(threads)
    ids = tokens(n)
    extra: dict = {}
    if tool in ("sdpa", "sdpa-last"):
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa",
                                                                  dtype=torch.float32).eval().to(device)
        x = torch.tensor([ids], device=device)
        keep = {"logits_to_keep": 1} if tool == "sdpa-last" else {}

        def once():
            with torch.no_grad():
                return model(input_ids=x, use_cache=False, **keep).logits
    elif tool == "headlab":
        import headlab
        from headlab.model import load_model
        from headlab.plugins.detectors import patterns
        from headlab.spec import ModelSpec

        lm = load_model(ModelSpec(path=checkpoint, device=device, dtype="float32"))
        ctx = headlab.StepContext(model=lm, examples=[headlab.Example(prompt="", input_ids=ids)], results={}, seed=0)
        config = patterns.Induction()

        def once():
            ds = patterns.detect(config, ctx)
            extra["probe"] = ds.attrs["probe"]
            return ds["score"].transpose("layer", "head").values
    else:
        from transformer_lens import TransformerBridge
        from transformer_lens.head_detector import detect_head

        model = TransformerBridge.boot_transformers(checkpoint, device=device, dtype=torch.float32)
        x = torch.tensor([ids], device=device)
        model.to_tokens = lambda *a, **k: x  # detect_head tokenizes its string: hand it the tokens instead

        def once():
            with torch.no_grad():
                return detect_head(model, "", "induction_head").numpy()

    if device == "cuda":
        torch.cuda.synchronize()
    base = memory_base(device)
    times, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        out = once()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        if tool in ("headlab", "tl"):
            np.save(scores_out, np.asarray(out, dtype=np.float64))
        del out
    return {"seconds": statistics.median(times), "cpu_seconds": statistics.median(cpu), "runs": times,
            "peak_bytes": peak_growth(device, base), **extra}


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"- ({r['error']})"
    return f"{r['seconds']:.1f} s (CPU {r['cpu_seconds']:.1f} s), {r['peak_bytes'] / 2**20:,.0f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    p.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "headlab-bench-llama"))
    p.add_argument("--tl-python", default=str(Path(__file__).resolve().parent.parent / ".venv-tl" / "bin" / "python"),
                   help="interpreter with transformer-lens installed (a separate virtual environment)")
    p.add_argument("--reps", type=int, default=1, help="runs per tool and length (the median is shown)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="skip a tool whose predicted peak exceeds this (default: 90%% of the available memory)")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_scores", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._case:
        print(json.dumps(measure(args._case, args.lengths[0], args.checkpoint, args.reps, args.threads, args.device,
                                 args._scores)))
        return
    import numpy as np

    ckpt = Path(args.checkpoint)
    if not (ckpt / "model.safetensors").exists():
        print(f"building the random checkpoint in {ckpt}")
        build_checkpoint(ckpt)
    limit = (args.mem_limit_gib * 2**30) if args.mem_limit_gib else 0.9 * mem_available()
    tl_ok = Path(args.tl_python).exists()
    print(f"random Llama {LAYERS} layers x {HEADS} heads x d{HEAD_DIM}, hidden {HIDDEN}, vocabulary {VOCAB}; "
          f"induction scores on BOS + r + r; {args.device}, threads={args.threads or 'default'}, reps={args.reps}, "
          f"memory limit {limit / 2**30:.1f} GiB; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    rows = []
    work = Path(tempfile.mkdtemp(prefix="bench-detectors-"))
    for n in args.lengths:
        res: dict[str, dict] = {}
        for tool in args.tools:
            if tool == "tl" and not tl_ok:
                res[tool] = {"error": f"no interpreter {args.tl_python}"}
                continue
            need = predicted_bytes(tool, n)
            if need > limit:
                res[tool] = {"error": f"predicted {need / 2**30:.0f} GiB > {limit / 2**30:.0f} GiB"}
                continue
            python = args.tl_python if tool == "tl" else sys.executable
            scores = work / f"{tool}-{n}.npy"
            cmd = [python, __file__, "--_case", tool, "--lengths", str(n), "--checkpoint", str(ckpt),
                   "--reps", str(args.reps), "--threads", str(args.threads), "--device", args.device,
                   "--_scores", str(scores)]
            res[tool] = run_case(cmd, args.timeout)
            res[tool]["load"] = os.getloadavg()[0]
        diff = None
        if "error" not in res.get("headlab", {"error": 1}) and "error" not in res.get("tl", {"error": 1}):
            diff = float(np.abs(np.load(work / f"headlab-{n}.npy") - np.load(work / f"tl-{n}.npy")).max())
        rows.append({"tokens": n + 1, "results": res, "max_abs_diff_vs_tl": diff})
        sd, sl, hl, tl = (res.get(t, {"error": "not run"}) for t in TOOLS)
        print(f"\n== {n + 1} tokens")
        print(f"  plain SDPA forward        {_fmt(sd)}")
        print(f"  SDPA, last logits only    {_fmt(sl)}")
        print(f"  headlab induction         {_fmt(hl)}  probe={hl.get('probe', '-')}  vs SDPA: time "
              f"{ratio(hl, sd, 'seconds')} (CPU {ratio(hl, sd, 'cpu_seconds')}), peak {ratio(hl, sd, 'peak_bytes')}; "
              f"vs SDPA last logits: time {ratio(hl, sl, 'seconds')} (CPU {ratio(hl, sl, 'cpu_seconds')}), peak "
              f"{ratio(hl, sl, 'peak_bytes')}")
        print(f"  TransformerLens detect    {_fmt(tl)}  vs headlab: time {ratio(tl, hl, 'seconds')}, "
              f"peak {ratio(tl, hl, 'peak_bytes')}")
        if diff is not None:
            print(f"  headlab vs TL scores: max |diff| = {diff:.2e}")
    print("\n| tokens | plain SDPA forward | SDPA, last logits only | headlab `induction` | headlab vs SDPA "
          "(time, CPU time, peak) | vs SDPA last logits | TransformerLens `detect_head` | max abs diff vs TL |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        sd, sl, hl, tl = (row["results"].get(t, {"error": "not run"}) for t in TOOLS)
        d = "-" if row["max_abs_diff_vs_tl"] is None else f"{row['max_abs_diff_vs_tl']:.1e}"
        print(f"| {row['tokens']:,} | {_fmt(sd)} | {_fmt(sl)} | {_fmt(hl)} | {ratio(hl, sd, 'seconds')}, "
              f"{ratio(hl, sd, 'cpu_seconds')}, {ratio(hl, sd, 'peak_bytes')} | {ratio(hl, sl, 'seconds')}, "
              f"{ratio(hl, sl, 'cpu_seconds')}, {ratio(hl, sl, 'peak_bytes')} | {_fmt(tl)} | {d} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
