"""Exact head-output patching over all positions of every head: headlab vs a per-head hook loop vs
TransformerLens, and attribution patching (AtP) and EAP-IG's memory per token (against EAP-IG's dense layout)
beside it (not a test).

Full size (what the merger runs; 8 layers, short and long regimes, every tool)::

    python benchmarks/bench_patching.py --threads 1 --reps 1 [--tl-python .venv-tl/bin/python] [--write]

Reduced (a check that everything runs, a few minutes of CPU)::

    python benchmarks/bench_patching.py --layers 2 --short-pairs 4 --long-tokens 256 --reps 1

One random Llama checkpoint (``--layers`` x 16 heads x head dim 32, hidden 512, MLP 1024, vocabulary 32000,
seeded) is built and saved once (``--checkpoint``; nothing is downloaded); every tool loads it from disk.
Two regimes of clean/corrupted pairs of random tokens:

- ``short`` (as in IOI and factual recall): ``--short-pairs`` 32 pairs of 24 tokens; the corrupted prompt
  swaps the tokens at positions ``--short-differ`` (default 2, the first name or the subject) and 12 (its
  second mention);
- ``long`` (as in key-value retrieval): 1 pair of ``--long-tokens`` 1024 tokens whose corrupted prompt swaps
  the key token at ``--long-differ`` (default: the middle) and its mention as the query, the last token.

The answer and wrong tokens are the random model's own: per pair, the tokens whose last-position logit the
corruption lowers the most and raises the most (one float32 forward of each prompt with transformers, when the
pairs are first used with a checkpoint; kept beside it as ``answers-<regime>-<digest>.json``, so every tool
reads the same pairs). A pair's clean - corrupt logit difference is then the largest any choice gives, as in
an experiment on a behaviour that the corruption changes: the score divides by it, and with a gap near float32
noise (tokens drawn at random gave 5e-3 on the long pair) the scores of two exact tools differ far more than
their patched metrics do. It is printed per regime (mean over the pairs and the smallest).

The metric is the logit difference at the last position; every tool patches each head's output ``z`` at
every position (denoising: clean values into the corrupted run), for all pairs, and reports the mean patched
metric per head and the score ``(mean patched - mean corrupt) / (mean clean - mean corrupt)``. Each tool runs
in a fresh process (its peak memory is its own):

- ``headlab``: the ``activation_patching`` detector (``unit: z``, ``resume: true``, ``batch_size``
  ``--batch-size`` rows, all pairs in one chunk): the clean and corrupted runs once, then rows of batched
  forwards, one patched head per row, each starting at the patched layer from the corrupted run's residual
  stream, over the positions from the first differing token (the keys and values before it the corrupted
  run's), logits at the last position only;
- ``headlab-full``: the same with ``resume: false`` (every patched forward from the embeddings over every
  position; logits at the last position only): what the skipping saves;
- ``hooks``: a per-head hook loop on the transformers model (SDPA): one forward of the corrupted prompts per
  head with a forward pre-hook on ``o_proj`` writing the clean run's slice of that head, last logits only;
- ``tl``: TransformerLens ``patching.get_act_patch_attn_head_out_all_pos`` on
  ``TransformerBridge.boot_transformers(checkpoint)``, after ``run_with_cache`` of the clean prompts and a
  forward of the corrupted ones (one full forward with full logits per head), in its own interpreter
  (``--tl-python``: a separate virtual environment, ``python3 -m venv .venv-tl && .venv-tl/bin/pip install
  torch==2.13.0 transformers==5.24.0 transformer-lens==4.3.0``; skipped when absent);
- ``atp``: the ``attribution_patching`` detector (``unit: z``) over the same pairs; its time is also given
  in forwards (one plain forward of the corrupted prompts, last logits, timed in the same process: wall
  time, and CPU time, which a loaded machine disturbs less).
- ``eap``: the ``edge_attribution`` detector with ``method: eap_ig`` (``--ig-steps`` 5; all pairs in one chunk)
  over the same pairs: its time and peak growth, and its memory per token per example against EAP-IG's
  reference layout, a (batch, tokens, sources, d_model) activation-difference tensor, i.e. sources (1 +
  layers x (heads + 1): the embeddings, every head, every MLP) x d_model x element size
  (:func:`dense_bytes_per_token`). headlab's figures are the detector's attrs: ``activation_bytes_per_token``
  (every head's ``z``, head_dim wide, projected through ``W_O`` on the fly, every MLP's output and the
  embeddings) and ``gradient_bytes_per_token`` (one step's gradients), equal to :func:`kept_bytes_per_token`
  of the shape; printed with the ratios dense / activations and dense / (activations + gradients). On the
  long regime it runs again, in another process, at ``--eap-scale-tokens`` tokens (default half of
  ``--long-tokens``; 0: not): the difference of the two peaks over the difference of the tokens is the
  measured bytes per added token, printed beside the dense layout's and beside one layer's query, key and
  value destination gradients (``heads + 2 x kv_heads`` of d_model each, float32), which the detector holds
  while it scores a step (``--malloc-mmap-threshold 65536`` makes the peak RSS follow the live tensors: glibc's
  default dynamic threshold keeps freed blocks resident, as docs/kv.md explains for bench_kv.py). After the
  regimes: the same ratios for Llama-3-8B's shape (32 layers x 32 heads, 8 KV heads, head dim 128, d_model
  4096, bf16), from the shape alone: 1,057 sources x 4096 x 2 B = 8.66 MB per token per example dense, 0.53 MB
  of headlab's activation differences (16.3x less), 1.46 MB with one step's gradients (5.9x), 2.25 MB with one
  layer's destination gradients (3.8x). A reduced run (``--layers 2 --short-pairs 4 --long-tokens 256 --reps 1
  --tools eap --malloc-mmap-threshold 65536``, one thread): 10.0 KiB kept per token (+ 22.0 KiB of gradients)
  against 70.0 KiB dense (7.00x); the measured peak grew by 201 KiB per added token on the long pair (177 MiB at
  128 tokens, 202 MiB at 256), 2.1x one layer's 48 destination gradients (the backward's activations are the
  rest). With two layers the dense tensor is small (35 sources); it grows with the layers, the transient does
  not. Before the pull-back was computed in closed form it grew by 1.8 to 1.9 MiB per added token (27x the
  dense tensor; docs/circuits.md).

Heads/s = heads patched (layers x 16, each over all pairs) per second of the whole computation (clean and
corrupted runs included; model loading excluded), median of ``--reps``; CPU time beside wall time; peak =
growth of the peak RSS over the RSS after loading (CPU), ``max_memory_allocated`` on CUDA. The FLOP bound is
computed from the model shape (2 x multiply-adds of the projections, the MLP, causal attention over the keys
each query sees and the unembedding): TransformerLens' forwards (every layer, every position, full logits)
over headlab's (the layers from the patched one, the positions from the first differing token, one logit
row per patched row), printed beside the measured heads/s ratio. The largest differences of the mean patched
metric and of the score are against headlab's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import memory_base, peak_growth, run_case  # noqa: E402

HEADS, HEAD_DIM, HIDDEN, MLP, VOCAB = 16, 32, 512, 1024, 32000
TOOLS = ("headlab", "headlab-full", "hooks", "tl", "atp", "eap")
SECOND_MENTION = 12
FLOAT32 = 4
#: Llama-3-8B's shape (bf16), for the dense layout's bytes per token quoted in the issue (8.66 MB)
LLAMA3_8B = {"layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128, "d_model": 4096, "element_size": 2}


def build_checkpoint(path: Path, layers: int) -> None:
    """Save the seeded random Llama and a word-level tokenizer (``<s>``, ``t3 .. t31999``) to ``path``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="</s>")
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=layers,
                                   num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                                   vocab_size=VOCAB, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)


def prompts(regime: str, args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """``(clean ids, corrupted ids)`` of the regime's pairs (BOS first, seeded; module docstring)."""
    rng = random.Random(regime)
    if regime == "short":
        n, T, where = args.short_pairs, args.short_tokens, [args.short_differ, SECOND_MENTION]
    else:
        T = args.long_tokens
        n, where = 1, [args.long_differ if args.long_differ is not None else T // 2, T - 1]
    clean, corrupt = [], []
    for _ in range(n):
        c = [1] + [rng.randrange(3, VOCAB) for _ in range(T - 1)]
        name, other = c[where[0]], rng.randrange(3, VOCAB)
        k = list(c)
        for p in where:
            if p < T - 1 or regime == "long":  # every mention swapped (short: the last position is the query)
                c[p], k[p] = name, other
        clean.append(c)
        corrupt.append(k)
    return clean, corrupt


def choose_answers(checkpoint: Path, clean: list[list[int]], corrupt: list[list[int]]) -> dict:
    """Per pair, the answer and wrong tokens: those (of ``t3 ..``) whose last-position logit the corruption
    lowers the most and raises the most (one float32 forward of each prompt on the checkpoint), so that the
    pair's ``clean - corrupt`` logit difference (``gap``) is the largest any choice gives."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        d = (model(input_ids=torch.tensor(clean), logits_to_keep=1).logits[:, -1].double()
             - model(input_ids=torch.tensor(corrupt), logits_to_keep=1).logits[:, -1].double())
    d = d[:, 3:]  # not <unk>, <s>, </s>
    top, bottom = d.max(1), d.min(1)
    return {"answer": (top.indices + 3).tolist(), "wrong": (bottom.indices + 3).tolist(),
            "gap": (top.values - bottom.values).tolist()}


def answers(regime: str, args: argparse.Namespace) -> dict:
    """:func:`choose_answers` of the regime's pairs, computed once per checkpoint and pairs and kept beside the
    checkpoint (every tool reads them)."""
    clean, corrupt = prompts(regime, args)
    digest = hashlib.sha256(json.dumps([clean, corrupt]).encode()).hexdigest()[:16]
    path = Path(args.checkpoint) / f"answers-{regime}-{digest}.json"
    if not path.exists():
        path.write_text(json.dumps(choose_answers(Path(args.checkpoint), clean, corrupt)))
    return json.loads(path.read_text())


def pairs(regime: str, args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
    """``(clean ids, corrupted ids, answer ids, wrong ids)`` of the regime's pairs (:func:`answers`)."""
    clean, corrupt = prompts(regime, args)
    chosen = answers(regime, args)
    return clean, corrupt, chosen["answer"], chosen["wrong"]


def first_differing(clean: list[list[int]], corrupt: list[list[int]]) -> int:
    """The first position where some pair's prompts differ."""
    return min(next(i for i, (a, b) in enumerate(zip(c, k, strict=True)) if a != b)
               for c, k in zip(clean, corrupt, strict=True))


def flops(layers: int, rows: int, T: int, *, start_layer: int = 0, start: int = 0, logit_rows: int = 1) -> float:
    """FLOPs (2 x multiply-adds) of ``rows`` forwards of ``T`` tokens run from layer ``start_layer`` over the
    positions ``start..T-1`` (causal attention over the keys each sees), with ``logit_rows`` logit rows each."""
    proj = 2 * HIDDEN * HEADS * HEAD_DIM * 4
    mlp = 2 * 3 * HIDDEN * MLP
    keys = sum(q + 1 for q in range(start, T))
    attn = 2 * 2 * HEADS * HEAD_DIM * keys
    return rows * ((layers - start_layer) * ((T - start) * (proj + mlp) + attn) + logit_rows * 2 * HIDDEN * VOCAB)


def flop_bound(layers: int, n: int, T: int, shared: int) -> dict:
    """TransformerLens' FLOPs, headlab's, and the ratio (with the shared prefix and without it)."""
    tl = (2 + layers * HEADS) * flops(layers, n, T, logit_rows=T)
    ours_base = flops(layers, 2 * n, T)  # clean and corrupted runs, last logits
    ours = ours_base + sum(flops(layers, HEADS * n, T, start_layer=ly, start=shared) for ly in range(layers))
    no_prefix = ours_base + sum(flops(layers, HEADS * n, T, start_layer=ly) for ly in range(layers))
    return {"tl": tl, "headlab": ours, "ratio": tl / ours, "ratio_no_prefix": tl / no_prefix}


def n_sources(layers: int, heads: int) -> int:
    """The sources of edge_attribution's graph: the embeddings, every head and every MLP."""
    return 1 + layers * (heads + 1)


def dense_bytes_per_token(layers: int, heads: int, d_model: int, element_size: int) -> int:
    """Bytes per token per example of EAP-IG's reference layout: a (batch, tokens, sources, d_model)
    activation-difference tensor."""
    return n_sources(layers, heads) * d_model * element_size


def kept_bytes_per_token(layers: int, heads: int, kv_heads: int, head_dim: int, d_model: int,
                         element_size: int) -> dict[str, int]:
    """Bytes per token per example of what headlab's edge_attribution keeps, from the shape alone:
    ``activation`` (one set of the sources' outputs: every head's ``z``, head_dim wide, every MLP's output and
    the embeddings) and ``gradient`` (one step's: the q/k/v projections' outputs, per query and key/value
    head, the attention norms' inputs, the MLP and logits destinations)."""
    return {"activation": (layers * heads * head_dim + layers * d_model + d_model) * element_size,
            "gradient": (layers * (heads + 2 * kv_heads) * head_dim + 2 * layers * d_model + d_model) * element_size}


def eap_memory(layers: int, heads: int, kv_heads: int, head_dim: int, d_model: int, element_size: int) -> dict:
    """:func:`dense_bytes_per_token` against :func:`kept_bytes_per_token`: the bytes and the ratios dense /
    headlab's activation differences and dense / (activations + gradients); and ``cotangents``, the bytes per
    token of one layer's query, key and value destination gradients, d_model wide each (float32, the
    detector's compute dtype below float64), which the detector holds while it scores a step."""
    dense = dense_bytes_per_token(layers, heads, d_model, element_size)
    kept = kept_bytes_per_token(layers, heads, kv_heads, head_dim, d_model, element_size)
    return {"sources": n_sources(layers, heads), "dense": dense, **kept, "ratio": dense / kept["activation"],
            "ratio_with_gradients": dense / (kept["activation"] + kept["gradient"]),
            "cotangents": (heads + 2 * kv_heads) * d_model * FLOAT32}


def _examples(clean, corrupt, answer, wrong):
    import headlab

    word = lambda ids: " ".join("<s>" if t == 1 else f"t{t}" for t in ids)  # noqa: E731
    return [headlab.Example(prompt=word(c), meta={"corrupt_prompt": word(k), "answer_id": a, "wrong_id": w})
            for c, k, a, w in zip(clean, corrupt, answer, wrong, strict=True)]


def measure(tool: str, regime: str, args: argparse.Namespace) -> dict:
    """Run one tool on one regime in this process: seconds (median), CPU seconds, peak growth, and the
    (layer, head) mean patched metric and score written to ``args._out``."""
    import numpy as np
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    clean, corrupt, answer, wrong = pairs(regime, args)
    n, device = len(clean), args.device
    extra: dict = {}
    if tool in ("headlab", "headlab-full", "atp", "eap"):
        import headlab
        from headlab.model import load_model
        from headlab.plugins.detectors import activation_patching, attribution_patching, edge_attribution
        from headlab.spec import ModelSpec

        lm = load_model(ModelSpec(path=args.checkpoint, device=device, dtype="float32"))
        examples = _examples(clean, corrupt, answer, wrong)
        assert headlab.tokenize(lm, examples[:1]).input_ids[0].tolist() == clean[0]
        ctx = headlab.StepContext(model=lm, examples=examples, results={}, seed=0)
        if tool == "atp":
            config = attribution_patching.AttributionPatching(unit="z", pair_batch_size=n)
            ids = torch.tensor(corrupt, device=device)

            def plain():
                return headlab.forward(lm, ids, logits_to_keep=1)[0].logits

            plain()
            t, c = time.perf_counter(), time.process_time()
            for _ in range(5):
                plain()
            extra["forward_seconds"] = (time.perf_counter() - t) / 5
            extra["forward_cpu_seconds"] = (time.process_time() - c) / 5

            def once():
                ds = attribution_patching.detect(config, ctx)
                return ds["score"].values * 0 + np.nan, ds["score"].values
        elif tool == "eap":
            config = edge_attribution.EdgeAttribution(method="eap_ig", ig_steps=args.ig_steps, pair_batch_size=n)

            def once():
                ds = edge_attribution.detect(config, ctx)
                extra.update({k: int(ds.attrs[k]) for k in EAP_ATTRS}, edges=int(ds.attrs["n_edges"]))
                return ds["score"].values * 0 + np.nan, ds["score"].values
        else:
            config = activation_patching.ActivationPatching(unit="z", batch_size=args.batch_size, pair_batch_size=n,
                                                            resume=tool == "headlab")

            def once():
                ds = activation_patching.detect(config, ctx)
                extra["path"] = f"start={ds.attrs['start']}, prefix={ds.attrs['prefix']}"
                return ds["patched"].mean("example").values, ds["score"].values
    elif tool == "hooks":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, attn_implementation="sdpa",
                                                                  dtype=torch.float32).eval().to(device)
        x_clean, x_corrupt = torch.tensor(clean, device=device), torch.tensor(corrupt, device=device)
        a, w = torch.tensor(answer, device=device), torch.tensor(wrong, device=device)
        layers = model.model.layers

        def metric(logits):
            last = logits[:, -1].double()
            return (last.gather(1, a[:, None]) - last.gather(1, w[:, None]))[:, 0]

        def once():
            seen: dict = {}
            handles = [layer.self_attn.o_proj.register_forward_pre_hook(
                lambda m, inp, i=i: seen.__setitem__(i, inp[0].detach())) for i, layer in enumerate(layers)]
            with torch.no_grad():
                m_clean = metric(model(input_ids=x_clean, logits_to_keep=1).logits).mean()
            for h in handles:
                h.remove()
            with torch.no_grad():
                m_corrupt = metric(model(input_ids=x_corrupt, logits_to_keep=1).logits).mean()
            patched = np.zeros((len(layers), HEADS))
            for i, layer in enumerate(layers):
                for head in range(HEADS):
                    sl = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)

                    def hook(m, inp, i=i, sl=sl):
                        x = inp[0].clone()
                        x[..., sl] = seen[i][..., sl]
                        return (x,)
                    handle = layer.self_attn.o_proj.register_forward_pre_hook(hook)
                    with torch.no_grad():
                        patched[i, head] = float(metric(model(input_ids=x_corrupt, logits_to_keep=1).logits).mean())
                    handle.remove()
            gap = float(m_clean - m_corrupt)
            return patched, (patched - float(m_corrupt)) / gap
    else:
        from transformer_lens import TransformerBridge, patching

        model = TransformerBridge.boot_transformers(args.checkpoint, device=device, dtype=torch.float32)
        model.eval()
        x_clean, x_corrupt = torch.tensor(clean, device=device), torch.tensor(corrupt, device=device)
        a, w = torch.tensor(answer, device=device), torch.tensor(wrong, device=device)

        def metric(logits):
            last = logits[:, -1].double()
            return (last.gather(1, a[:, None]) - last.gather(1, w[:, None]))[:, 0].mean()

        def once():
            with torch.no_grad():
                logits, cache = model.run_with_cache(x_clean)
                m_clean = float(metric(logits))
                m_corrupt = float(metric(model(x_corrupt)))
                patched = patching.get_act_patch_attn_head_out_all_pos(model, x_corrupt, cache, metric)
            patched = patched.double().cpu().numpy()
            return patched, (patched - m_corrupt) / (m_clean - m_corrupt)

    if device == "cuda":
        torch.cuda.synchronize()
    base = memory_base(device)
    times, cpu = [], []
    for _ in range(args.reps):
        t, c = time.perf_counter(), time.process_time()
        patched, score = once()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    np.savez(args._out, patched=np.asarray(patched, dtype=np.float64), score=np.asarray(score, dtype=np.float64))
    return {"seconds": statistics.median(times), "cpu_seconds": statistics.median(cpu), "runs": times,
            "peak_bytes": peak_growth(device, base), **extra}


EAP_ATTRS = ("activation_bytes_per_token", "gradient_bytes_per_token", "dense_bytes_per_token")


def _fmt(r: dict, heads: int) -> str:
    if "error" in r:
        return f"- ({r['error']})"
    if "activation_bytes_per_token" in r:
        return (f"{r['seconds']:.1f} s (CPU {r['cpu_seconds']:.1f} s), {r['peak_bytes'] / 2**20:,.0f} MiB; "
                f"EAP-IG, {r['edges']:,} edges")
    return (f"{r['seconds']:.1f} s (CPU {r['cpu_seconds']:.1f} s), {heads / r['seconds']:.1f} heads/s, "
            f"{r['peak_bytes'] / 2**20:,.0f} MiB")


def _case_command(tool: str, regime: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The command line of one tool's measurement on one regime in a fresh process."""
    python = args.tl_python if tool == "tl" else sys.executable
    cmd = [python, __file__, "--_case", tool, "--_regime", regime, "--_out", str(out),
           "--layers", str(args.layers), "--checkpoint", str(args.checkpoint), "--reps", str(args.reps),
           "--threads", str(args.threads), "--device", args.device, "--batch-size", str(args.batch_size),
           "--short-pairs", str(args.short_pairs), "--short-tokens", str(args.short_tokens),
           "--short-differ", str(args.short_differ), "--long-tokens", str(args.long_tokens),
           "--ig-steps", str(args.ig_steps)]
    if args.long_differ is not None:
        cmd += ["--long-differ", str(args.long_differ)]
    return cmd


def _kib(b: float) -> str:
    return f"{b / 1024:,.1f} KiB"


def _eap_lines(r: dict, shape: dict, scaling: dict | None, scale_tokens: int, T: int) -> str:
    """The eap tool's memory lines: headlab's kept bytes per token (the detector's attrs) against the dense
    layout's (from the shape), and with ``scaling`` (the long regime at ``scale_tokens``) the measured peak
    growth per token."""
    kept, grad = r["activation_bytes_per_token"], r["gradient_bytes_per_token"]
    dense = shape["dense"]
    lines = [f"    memory per token per example: headlab keeps {_kib(kept)} of activation differences "
             f"(+ {_kib(grad)} of one step's gradients); the dense layout {shape['sources']} sources x {HIDDEN} x "
             f"{FLOAT32} B = {_kib(dense)}: {dense / kept:.2f}x headlab's activations, "
             f"{dense / (kept + grad):.2f}x with its gradients"]
    if scaling is not None and "error" in scaling:
        lines.append(f"    peak growth at {scale_tokens} tokens: - ({scaling['error']})")
    elif scaling is not None:
        slope = (r["peak_bytes"] - scaling["peak_bytes"]) / (T - scale_tokens)
        lines.append(f"    measured: peak growth {scaling['peak_bytes'] / 2**20:,.0f} MiB at {scale_tokens} tokens, "
                     f"{r['peak_bytes'] / 2**20:,.0f} MiB at {T} ({_kib(r['peak_bytes'] / T)} per token): "
                     f"{_kib(slope)} per added token, {slope / dense:.2f}x the dense layout's tensor, "
                     f"{slope / shape['cotangents']:.1f}x one layer's {HEADS} + 2 x {HEADS} destination "
                     f"cotangents ({_kib(shape['cotangents'])})")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regimes", nargs="+", default=["short", "long"], choices=["short", "long"])
    p.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--short-pairs", type=int, default=32)
    p.add_argument("--short-tokens", type=int, default=24)
    p.add_argument("--short-differ", type=int, default=2, help="first corrupted position of the short pairs")
    p.add_argument("--long-tokens", type=int, default=1024)
    p.add_argument("--long-differ", type=int, default=None, help="corrupted position of the long pair (middle)")
    p.add_argument("--batch-size", type=lambda v: v if v == "auto" else int(v), default=256,
                   help="headlab rows (patched heads) per forward, or auto (as many as fit the memory budget)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="glibc malloc: serve blocks of at least BYTES by mmap (returned to the system when freed) "
                        "in every case's process, so that the peak RSS follows the live tensors "
                        "(MALLOC_MMAP_THRESHOLD_; default: glibc's dynamic threshold)")
    p.add_argument("--ig-steps", type=int, default=5, help="eap: EAP-IG interpolation steps")
    p.add_argument("--eap-scale-tokens", type=int, default=None,
                   help="eap: also measure the long regime at this many tokens (default: half of --long-tokens; "
                        "0: not) for the measured peak growth per added token")
    p.add_argument("--checkpoint", default=None, help="default: <tmp>/headlab-bench-patching-<layers>")
    p.add_argument("--tl-python", default=str(Path(__file__).resolve().parent.parent / ".venv-tl" / "bin" / "python"),
                   help="interpreter with transformer-lens installed (a separate virtual environment)")
    p.add_argument("--reps", type=int, default=1, help="runs per tool and regime (the median is shown)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_regime", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.checkpoint = args.checkpoint or os.path.join(tempfile.gettempdir(), f"headlab-bench-patching-{args.layers}")
    if args.eap_scale_tokens is None:
        args.eap_scale_tokens = args.long_tokens // 2
    if not 0 <= args.eap_scale_tokens < args.long_tokens:
        p.error(f"--eap-scale-tokens {args.eap_scale_tokens}: give 0 or fewer tokens than --long-tokens")
    if args.malloc_mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    if args._case:
        os.environ.setdefault("TQDM_DISABLE", "1")
        print(json.dumps(measure(args._case, args._regime, args)))
        return
    import numpy as np

    ckpt = Path(args.checkpoint)
    if not (ckpt / "model.safetensors").exists():
        print(f"building the random checkpoint in {ckpt}")
        build_checkpoint(ckpt, args.layers)
    tl_ok = Path(args.tl_python).exists()
    heads = args.layers * HEADS
    print(f"random Llama {args.layers} layers x {HEADS} heads x d{HEAD_DIM}, hidden {HIDDEN}, MLP {MLP}, vocabulary "
          f"{VOCAB}; head-output patching of all {heads} heads over all positions, logit difference; {args.device}, "
          f"threads={args.threads or 'default'}, reps={args.reps}, headlab batch_size={args.batch_size}; load "
          f"average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; allocator: glibc malloc, "
          f"{'MALLOC_MMAP_THRESHOLD_=' + os.environ['MALLOC_MMAP_THRESHOLD_'] if 'MALLOC_MMAP_THRESHOLD_' in os.environ else 'default thresholds'}")
    work = Path(tempfile.mkdtemp(prefix="bench-patching-"))
    rows = []
    for regime in args.regimes:
        clean, corrupt = prompts(regime, args)
        gap = answers(regime, args)["gap"]  # chosen here, before any tool runs
        n, T, shared = len(clean), len(clean[0]), first_differing(clean, corrupt)
        bound = flop_bound(args.layers, n, T, shared)
        res: dict[str, dict] = {}
        for tool in args.tools:
            if tool == "tl" and not tl_ok:
                res[tool] = {"error": f"no interpreter {args.tl_python}"}
                continue
            res[tool] = run_case(_case_command(tool, regime, args, work / f"{tool}-{regime}.npz"), args.timeout)
            res[tool]["load"] = os.getloadavg()[0]
        scaling = None
        if regime == "long" and "eap" in args.tools and args.eap_scale_tokens:
            half = argparse.Namespace(**{**vars(args), "long_tokens": args.eap_scale_tokens, "long_differ": None})
            answers(regime, half)
            scaling = run_case(_case_command("eap", regime, half, work / "eap-scale.npz"), args.timeout)
        diffs: dict[str, dict] = {}
        if "error" not in res.get("headlab", {"error": 1}):
            ours = np.load(work / f"headlab-{regime}.npz")
            for tool in ("headlab-full", "hooks", "tl"):
                if "error" not in res.get(tool, {"error": 1}):
                    other = np.load(work / f"{tool}-{regime}.npz")
                    diffs[tool] = {k: float(np.abs(ours[k] - other[k]).max()) for k in ("patched", "score")}
            if "error" not in res.get("atp", {"error": 1}):
                est = np.load(work / f"atp-{regime}.npz")["score"]
                from headlab.plugins.detectors.attribution_patching import spearman

                diffs["atp"] = {"spearman": spearman(ours["score"], est)}
        rows.append({"regime": regime, "pairs": n, "tokens": T, "first_differing": shared, "gap": gap, "flops": bound,
                     "results": res, "diffs": diffs, **({"eap_scale": scaling} if scaling else {})})
        hl, tl = res.get("headlab", {"error": "not run"}), res.get("tl", {"error": "not run"})
        print(f"\n== {regime}: {n} pair(s) of {T} tokens, first differing token at position {shared}; clean - "
              f"corrupt logit difference {statistics.mean(gap):.3f} (mean over pairs; smallest {min(gap):.3f})")
        for tool in args.tools:
            r = res[tool]
            line = f"  {tool:<13} {_fmt(r, heads)}"
            if "path" in r:
                line += f"  [{r['path']}]"
            if tool in diffs and "patched" in diffs[tool]:
                line += f"  max |diff| vs headlab: patched {diffs[tool]['patched']:.1e}, score {diffs[tool]['score']:.1e}"
            if tool == "atp" and "error" not in r:
                line += (f"  = {r['seconds'] / r['forward_seconds']:.1f} forwards ({r['forward_seconds'] * 1e3:.0f} ms "
                         f"each; CPU time {r['cpu_seconds'] / r['forward_cpu_seconds']:.2f} forwards); {r['seconds'] and (hl.get('seconds', float('nan')) / r['seconds']):.1f}x exact "
                         f"patching's heads/s, {args.layers * HEADS * r['forward_seconds'] / r['seconds']:.0f}x one "
                         f"forward per head's; Spearman vs exact {diffs.get('atp', {}).get('spearman', float('nan')):.3f}")
            print(line)
            if tool == "eap" and "error" not in r:
                print(_eap_lines(r, eap_memory(args.layers, HEADS, HEADS, HEAD_DIM, HIDDEN, FLOAT32), scaling,
                                 args.eap_scale_tokens, T))
        measured = (f"{tl['seconds'] / hl['seconds']:.2f}x (CPU time {tl['cpu_seconds'] / hl['cpu_seconds']:.2f}x)"
                    if "error" not in hl and "error" not in tl else "n/a")
        print(f"  headlab / TransformerLens heads/s: {measured} measured; FLOP bound {bound['ratio']:.2f}x "
              f"(TL {bound['tl'] / 1e12:.2f} TFLOP, headlab {bound['headlab'] / 1e12:.2f} TFLOP; "
              f"{bound['ratio_no_prefix']:.2f}x without the shared prefix)")
    if "eap" in args.tools:
        big = eap_memory(**LLAMA3_8B)
        print(f"\nLlama-3-8B shape (32 layers x 32 heads, 8 KV heads, head dim 128, d_model 4096, bf16), from the "
              f"shape alone: dense layout {big['sources']:,} sources x 4096 x 2 B = {big['dense'] / 1e6:.2f} MB per "
              f"token per example; headlab keeps {big['activation'] / 1e6:.2f} MB of activation differences "
              f"({big['ratio']:.1f}x less), {(big['activation'] + big['gradient']) / 1e6:.2f} MB with one step's "
              f"gradients ({big['ratio_with_gradients']:.1f}x less), "
              f"{(big['activation'] + big['gradient'] + big['cotangents']) / 1e6:.2f} MB with one layer's destination "
              f"gradients in float32 while a step is scored "
              f"({big['dense'] / (big['activation'] + big['gradient'] + big['cotangents']):.1f}x less)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
