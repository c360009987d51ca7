"""One script for a CUDA machine (written for an H200): Triton correctness, then Triton vs SDPA ratios.

    python benchmarks/gpu_check.py [--lengths 4096 8192 16384 32768] [--skip-model] [--skip-split] [--skip-wave3] [--write]

1. Correctness: the Triton path against the torch path (itself tested against a naive reference) on CUDA,
   fp32 / bf16 / fp16, GQA, left padding, edits, probes, softcap, window, decode with split keys; then the
   Triton tests of tests/test_kernels_triton.py and tests/test_patching_triton.py (the head output replacement
   of activation patching and the activation_patching detector, Triton == torch == SDPA) on CUDA.
2. Kernel timings per length (B=1, H=32, Hkv=8, D=128, bf16): SDPA vs Triton without probes, with
   argmax + span mass on every query, and with a PASTA span bias; decode (1 query vs the whole cache).
3. Model-level ratios through benchmarks/bench_kernels.py --device cuda (unless --skip-model).
4. A model split across the GPU and the CPU (``model: {device_map: ...}``, unless --skip-split): a tiny
   random Llama written to a temporary checkpoint, its first half on cuda:0 and its second half (with the
   norm and the unembedding) on the CPU, against the whole model on cuda:0: logits, an induction detection
   (attention probes), a generation steered by its top heads, successor heads (weights read from the
   offloaded layers) and a generation under a streaming KV policy (its tokens and cache bytes).
5. The wave-3 benchmarks on the GPU (unless --skip-wave3): head-output patching, headlab batched vs
   TransformerLens (benchmarks/bench_patching.py --device cuda, batch_size 256 and auto; target >= 10x TransformerLens' heads/s) and
   head-level KV policies after long prompts (benchmarks/bench_kv.py --device cuda: KV bytes, peak memory,
   decode tokens/s of full, streaming and kvpress).
Without CUDA it runs only a tiny CPU smoke check of the same code (torch path vs SDPA) and says so.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def case(B, H, Hkv, Nq, Nk, D, dtype, device, pad=0, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g).to(device, dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(device, dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(device, dtype)
    kpm = None
    if pad:
        kpm = torch.ones(B, Nk, dtype=torch.bool, device=device)
        kpm[-1, :pad] = False
    qs = torch.ones(B, H, device=device)
    qs[0, 1] = 0
    sz = torch.zeros(B, H, dtype=torch.bool, device=device)
    sz[-1, -1] = True
    os_ = torch.ones(B, H, device=device)
    os_[0, 0] = 0
    spans = torch.tensor([[0, Nk // 3], [Nk // 2, Nk - 1]], device=device).expand(B, 2, 2).contiguous()
    bias = torch.full((B, H, 2), math.log(0.05), device=device)
    from headlab.kernels import HeadEdits, ProbeRequest

    edits = HeadEdits(q_scale=qs, score_zero=sz, out_scale=os_, key_spans=spans, key_bias=bias)
    probes = ProbeRequest(argmax=True, entropy=True, spans=spans)
    return q, k, v, kpm, edits, probes


def maxdiff(a, b):
    return (a.double() - b.double()).abs().max().item() if a is not None and a.numel() else 0.0


def correctness(device: str) -> bool:
    from headlab.kernels import attention

    ok = True
    shapes = [(2, 8, 2, 300, 300, 64), (2, 8, 8, 1, 4100, 128), (1, 4, 1, 5, 2000, 64), (2, 8, 2, 257, 257, 128)]
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        for B, H, Hkv, Nq, Nk, D in shapes:
            for extra in (dict(), dict(softcap=20.0, window=97)):
                q, k, v, kpm, edits, probes = case(B, H, Hkv, Nq, Nk, D, dtype, device, pad=7)
                kw = dict(scale=D**-0.5, key_padding_mask=kpm, edits=edits, probes=probes, **extra)
                ref_o, ref = attention(q.float(), k.float(), v.float(), backend="torch", **kw)
                out, st = attention(q, k, v, backend="triton" if device == "cuda" else "torch", **kw)
                diffs = {
                    "z": maxdiff(out, ref_o), "argmax_prob": maxdiff(st.argmax_prob, ref.argmax_prob),
                    "entropy": maxdiff(st.entropy, ref.entropy), "span": maxdiff(st.span_mass, ref.span_mass),
                }
                agree = (st.argmax == ref.argmax).float().mean().item()
                good = all(d <= tol * (10 if n == "entropy" else 1) for n, d in diffs.items()) and agree > 0.97
                ok &= good
                print(f"  {'ok ' if good else 'BAD'} {str(dtype):15s} {(B, H, Hkv, Nq, Nk, D)} {extra or ''} "
                      + " ".join(f"{n}={d:.1e}" for n, d in diffs.items()) + f" argmax_agree={agree:.3f}")
    return ok


def bench(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return min(ts)


def kernel_timings(lengths):
    from headlab.kernels import HeadEdits, ProbeRequest, attention

    B, H, Hkv, D = 1, 32, 8, 128
    print(f"\nkernel timings, B={B} H={H} Hkv={Hkv} D={D} bf16 (ratios vs SDPA)")
    for n in lengths:
        q, k, v, _, edits, probes = case(B, H, Hkv, n, n, D, torch.bfloat16, "cuda")
        sc = D**-0.5
        argmax_span = ProbeRequest(argmax=True, spans=probes.spans)
        pasta = HeadEdits(key_spans=edits.key_spans, key_bias=edits.key_bias)
        t_sdpa = bench(lambda: attention(q, k, v, scale=sc, backend="sdpa"))  # noqa: B023
        t_plain = bench(lambda: attention(q, k, v, scale=sc, backend="triton"))  # noqa: B023
        t_probe = bench(lambda: attention(q, k, v, scale=sc, backend="triton", probes=argmax_span))  # noqa: B023
        t_pasta = bench(lambda: attention(q, k, v, scale=sc, backend="triton", edits=pasta))  # noqa: B023
        torch.cuda.reset_peak_memory_stats()
        attention(q, k, v, scale=sc, backend="triton", probes=argmax_span)
        mem = torch.cuda.max_memory_allocated() / 2**20
        qd = q[:, :, -1:].contiguous()
        t_dsdpa = bench(lambda: attention(qd, k, v, scale=sc, backend="sdpa"))  # noqa: B023
        t_dec = bench(lambda: attention(qd, k, v, scale=sc, backend="triton", probes=argmax_span))  # noqa: B023
        print(f"  {n:6d}: sdpa {t_sdpa * 1e3:8.2f} ms | triton plain {t_plain / t_sdpa:5.2f}x | "
              f"argmax+span {t_probe / t_sdpa:5.2f}x (peak {mem:.0f} MiB) | PASTA {t_pasta / t_sdpa:5.2f}x | "
              f"decode sdpa {t_dsdpa * 1e3:.3f} ms, triton+probes {t_dec / t_dsdpa:5.2f}x")


SPLIT_STEPS = """task: {kind: repeated_tokens, n: 4, length: 16}
steps:
  - id: ind
    detect: {kind: induction}
  - id: gen
    generate:
      max_new_tokens: 4
      steer: [{kind: head_scale, heads: {from: ind, top: 2}, factor: 0.0}]
  - id: succ
    detect: {kind: successor}
  - id: kv
    generate:
      max_new_tokens: 4
      kv: {kind: streaming, full_heads: {from: ind, top: 1}, sink: 1, window: 3}
"""


def split_check() -> bool:
    """A model split across cuda:0 and the CPU equals the whole model on cuda:0 (logits, probes, steering,
    weights read by a detector, a KV policy)."""
    import shutil
    import tempfile
    from pathlib import Path

    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    import headlab
    from headlab.model import load_model
    from headlab.spec import ModelSpec

    tiny = Path(__file__).resolve().parent.parent / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny"
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
             "model.layers.2": "cpu", "model.layers.3": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny / name, ckpt / name)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=811, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                     tie_word_embeddings=False)).save_pretrained(ckpt)
        whole = load_model(ModelSpec(path=str(ckpt), device="cuda"))
        parted = load_model(ModelSpec(path=str(ckpt), device_map=split))
        devices = sorted({str(p.device) for p in parted.model.parameters()})
        print(f"  split model: inputs on {parted.device}, parameters on {devices}")
        ok &= parted.device == "cuda:0" and devices == ["cpu", "cuda:0"]
        ids = torch.tensor([whole.tokenizer("the cat sat on the mat and the dog sat on the rug")["input_ids"]])
        with torch.no_grad():
            diff = maxdiff(whole.model(ids.cuda()).logits.cpu(), parted.model(ids.cuda()).logits.cpu())
        print(f"  logits max diff {diff:.1e}")
        ok &= diff < 1e-4
        runs = {}
        for name, model in (("whole", f"{{path: {ckpt}, device: cuda}}"),
                            ("split", f"{{path: {ckpt}, device_map: {split}}}".replace("'", ""))):
            runs[name] = headlab.run(f"name: {name}\nmodel: {model}\n{SPLIT_STEPS}", out=Path(tmp) / "runs")
        for step, var in (("ind", "score"), ("gen", "output"), ("succ", "score"), ("kv", "output"),
                          ("kv", "kv_bytes")):
            a, b = runs["whole"].results[step][var].values, runs["split"].results[step][var].values
            same = np.array_equal(a, b) if a.dtype.kind in "OUST" else np.allclose(a, b, atol=1e-4, equal_nan=True)
            print(f"  {step}.{var}: {'equal' if same else 'DIFFERENT'}")
            ok &= bool(same)
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--skip-split", action="store_true", help="skip the model split across the GPU and the CPU")
    p.add_argument("--skip-wave3", action="store_true", help="skip bench_patching.py and bench_kv.py on the GPU")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: running the CPU smoke check only (torch path), skipping Triton and timings")
        from headlab.kernels import attention

        q, k, v, kpm, _, _ = case(2, 4, 2, 33, 33, 16, torch.float32, "cpu", pad=3)
        a, _ = attention(q, k, v, scale=0.25, key_padding_mask=kpm, backend="sdpa")
        b, _ = attention(q, k, v, scale=0.25, key_padding_mask=kpm, backend="torch")
        print(f"  torch vs sdpa max diff {maxdiff(a, b):.1e}")
        sys.exit(0)
    print(f"device: {torch.cuda.get_device_name()}")
    print("correctness: triton vs torch path")
    ok = correctness("cuda")
    env = dict(os.environ, HEADLAB_TRITON_CUDA="1")
    files = ("test_kernels_triton.py", "test_patching_triton.py")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "triton",
                        *(os.path.join(os.path.dirname(__file__), "..", "tests", f) for f in files)],
                       env=env, capture_output=True, text=True)
    print(f"  pytest tests/{{{','.join(files)}}} on CUDA:", (r.stdout.strip().splitlines() or ["?"])[-1])
    ok &= r.returncode == 0
    if not args.skip_split:
        print("a model split across cuda:0 and the CPU (device_map) vs the whole model on cuda:0")
        ok &= split_check()
    kernel_timings(args.lengths)
    if not args.skip_model:
        subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "bench_kernels.py"),
                        "--device", "cuda", "--dtype", "bfloat16", "--reps", "3", "--lengths",
                        *map(str, args.lengths), "--eager-max", "16384", "--pasta-length", "8192"])
    if not args.skip_wave3:
        here = os.path.dirname(__file__)
        for batch in ("256", "auto"):  # the CPU setting, and rows sized to the GPU's memory
            subprocess.run([sys.executable, os.path.join(here, "bench_patching.py"), "--device", "cuda", "--threads",
                            "0", "--batch-size", batch, *(["--tools", "headlab"] if batch == "auto" else [])])
        subprocess.run([sys.executable, os.path.join(here, "bench_kv.py"), "--device", "cuda", "--dtype", "bfloat16",
                        "--lengths", "8192", "32768", "--threads", "0"])
    print("\nCORRECTNESS", "OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
