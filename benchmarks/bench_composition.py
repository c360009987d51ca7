"""Composition scores: headlab's ``composition`` detector vs TransformerLens ``all_composition_scores`` (not a test).

    python benchmarks/bench_composition.py [--cases llama-4x8 gpt2-4x8 llama-6x12] --threads 1 [--write] \
        [--tl-python .venv-tl/bin/python] [--reps 3]

Per case, one seeded random checkpoint is built locally and saved once (no weights are downloaded): a Llama
with grouped-query attention (half as many key/value heads as query heads, RMS norms) or a GPT-2 (LayerNorm),
with random norm gains (and LayerNorm biases) so that folding them matters. Both tools load it from disk and
run in fresh processes of their own (so each peak memory is its own):

- ``headlab``: ``composition_scores`` (Q, K and V at once: one product per pair of layers through the d_head x
  d_head QR factors), then the whole ``composition`` detector as a step runs it (with its 200-sample random
  baseline), float32;
- ``tl``: ``TransformerBridge.boot_transformers(checkpoint)`` with ``enable_compatibility_mode()`` (fold_ln,
  center_writing_weights, as ``HookedTransformer`` processes weights), then ``all_composition_scores`` for "Q",
  "K" and "V" (``FactoredMatrix`` products broadcast over every pair of heads), float32. TransformerLens runs
  in its own interpreter (``--tl-python``: a separate virtual environment, its pins conflict with headlab's;
  ``python3 -m venv .venv-tl && .venv-tl/bin/pip install transformer-lens torch==2.13.0``); skipped when absent.

Time: the median of ``--reps`` runs in one process (loading excluded), wall clock and CPU time; peak memory:
growth of the peak RSS over the RSS after loading. Both write their (3, layer, head, layer, head) scores; the
table shows the largest absolute difference. A tool whose predicted peak exceeds ``--mem-limit-gib`` (default:
60% of the memory available when the benchmark starts) is skipped and says so.
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

#: name -> (architecture, layers, heads, head_dim)
CASES = {"llama-4x8": ("llama", 4, 8, 64), "gpt2-4x8": ("gpt2", 4, 8, 64), "llama-6x12": ("llama", 6, 12, 64),
         "llama-8x16": ("llama", 8, 16, 64)}
VOCAB = 1000


def build_checkpoint(case: str, path: Path) -> None:
    """Save the case's seeded random model (random norm gains and biases) and a word-level tokenizer (``t3 ..
    t999``) to ``path``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(path)

    arch, layers, heads, head_dim = CASES[case]
    d = heads * head_dim
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=d, n_layer=layers, n_head=heads, vocab_size=VOCAB, n_positions=256,
                                      bos_token_id=1, eos_token_id=2)
    else:
        cfg = transformers.LlamaConfig(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                                       num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=head_dim,
                                       vocab_size=VOCAB, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen) if name.endswith("weight")
                        else 0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)


def predicted_bytes(tool: str, case: str) -> float:
    """A rough peak (float32), to skip what cannot fit: TransformerLens broadcasts a (d_head, d_model) factor
    over every pair of heads; headlab holds one (heads x d_head) x (3 x heads x d_head) product."""
    _, layers, heads, head_dim = CASES[case]
    d = heads * head_dim
    if tool == "tl":
        return 3 * (layers * heads) ** 2 * head_dim * d * 4
    return 3 * d * d * 4 + 16 * d * d * 4


def measure(tool: str, checkpoint: str, reps: int, threads: int, scores_out: str) -> dict:
    """Run one tool in this process; returns seconds (median), CPU seconds, peak growth."""
    import numpy as np
    import torch

    if threads:
        torch.set_num_threads(threads)
    extra: dict = {}
    if tool == "headlab":
        import headlab
        from headlab.model import load_model
        from headlab.plugins.detectors import composition
        from headlab.spec import ModelSpec

        lm = load_model(ModelSpec(path=checkpoint, device="cpu", dtype="float32"))
        ctx = headlab.StepContext(model=lm, examples=[headlab.Example(prompt="x")], results={}, seed=0)

        def once():
            t = time.perf_counter()
            ds = composition.detect(composition.Composition(), ctx)
            extra["detector_seconds"] = time.perf_counter() - t
            return np.stack([ds[f"{m}_comp"].values for m in ("q", "k", "v")])

        def scores_only():
            return composition.composition_scores(lm, "float32")
    else:
        from transformer_lens import TransformerBridge

        model = TransformerBridge.boot_transformers(checkpoint, device="cpu", dtype=torch.float32)
        model.enable_compatibility_mode()

        def scores_only():
            with torch.no_grad():
                out = [model.all_composition_scores(m) for m in ("Q", "K", "V")]
            return np.stack([getattr(o, "scores", o).numpy() for o in out])

        once = None
    base = memory_base("cpu")
    times, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        out = scores_only()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        np.save(scores_out, np.asarray(out, dtype=np.float64))
        del out
    peak = peak_growth("cpu", base)
    if once is not None:
        once()
    return {"seconds": statistics.median(times), "cpu_seconds": statistics.median(cpu), "runs": times,
            "peak_bytes": peak, **extra}


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"- ({r['error']})"
    return f"{r['seconds']:.3f} s (CPU {r['cpu_seconds']:.3f} s), peak +{r['peak_bytes'] / 2**20:,.0f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["llama-4x8", "gpt2-4x8", "llama-6x12"], choices=sorted(CASES))
    p.add_argument("--tl-python", default=str(Path(__file__).resolve().parent.parent / ".venv-tl" / "bin" / "python"),
                   help="interpreter with transformer-lens installed (a separate virtual environment)")
    p.add_argument("--reps", type=int, default=3, help="runs per tool and case (the median is shown)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="skip a tool whose predicted peak exceeds this (default: 60%% of the available memory)")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "headlab-bench-composition"))
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_checkpoint", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_scores", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._case:
        print(json.dumps(measure(args._case, args._checkpoint, args.reps, args.threads, args._scores)))
        return
    import numpy as np

    work = Path(args.workdir)
    limit = (args.mem_limit_gib * 2**30) if args.mem_limit_gib else 0.6 * mem_available()
    tl_ok = Path(args.tl_python).exists()
    print(f"composition scores (Q, K, V) of random checkpoints, float32, CPU, threads={args.threads or 'default'}, "
          f"reps={args.reps}, memory limit {limit / 2**30:.1f} GiB; load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs")
    rows = []
    for case in args.cases:
        ckpt = work / case
        if not (ckpt / "model.safetensors").exists():
            build_checkpoint(case, ckpt)
        res: dict[str, dict] = {}
        for tool in ("headlab", "tl"):
            if tool == "tl" and not tl_ok:
                res[tool] = {"error": f"no interpreter {args.tl_python}"}
                continue
            need = predicted_bytes(tool, case)
            if need > limit:
                res[tool] = {"error": f"predicted {need / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB"}
                continue
            python = args.tl_python if tool == "tl" else sys.executable
            cmd = [python, __file__, "--_case", tool, "--_checkpoint", str(ckpt), "--_scores",
                   str(work / f"{case}-{tool}.npy"), "--reps", str(args.reps), "--threads", str(args.threads)]
            res[tool] = run_case(cmd, args.timeout)
        diff = None
        if "error" not in res["headlab"] and "error" not in res["tl"]:
            diff = float(np.abs(np.load(work / f"{case}-headlab.npy") - np.load(work / f"{case}-tl.npy")).max())
        arch, layers, heads, head_dim = CASES[case]
        rows.append({"case": case, "results": res, "max_abs_diff": diff})
        hl, tl = res["headlab"], res["tl"]
        print(f"\n== {case}: {arch}, {layers} layers x {heads} heads x d_head {head_dim}"
              f"{' (GQA: ' + str(heads // 2) + ' kv heads)' if arch == 'llama' else ''}")
        print(f"  headlab composition_scores  {_fmt(hl)}"
              + (f"; the whole detector with its baseline {hl['detector_seconds']:.3f} s" if "error" not in hl else ""))
        print(f"  TransformerLens Q+K+V       {_fmt(tl)}")
        print(f"  TL / headlab: time {ratio(tl, hl, 'seconds')}, CPU {ratio(tl, hl, 'cpu_seconds')}, "
              f"peak {ratio(tl, hl, 'peak_bytes')}; max |diff| = {'-' if diff is None else f'{diff:.1e}'}")
    print("\n| case | headlab (time, peak) | TransformerLens (time, peak) | TL / headlab time | TL / headlab peak "
          "| max abs diff |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        hl, tl = row["results"]["headlab"], row["results"]["tl"]
        d = "-" if row["max_abs_diff"] is None else f"{row['max_abs_diff']:.1e}"
        print(f"| {row['case']} | {_fmt(hl)} | {_fmt(tl)} | {ratio(tl, hl, 'seconds')} | {ratio(tl, hl, 'peak_bytes')} "
              f"| {d} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
