"""Per-token cost of each decoding strategy relative to greedy, measured side by side in one run, and
DeCoRe's batched forward against the reference-style loop (batch size 1, two forwards per token).

    python benchmarks/bench_decoding.py [--model tiny|random|big] [--batch 8] [--new 32] [--reps 5] [--threads 1] [--write]
        [--first-layer N] [--device cpu|cuda]

Per strategy: the decode cost per token = the time of one step (from one forward call of the model to
the next: the forward, the strategy's choice and the loop), as the 10th percentile over every step of
``--reps`` alternating repetitions: the prefill is not counted, and a low percentile is the cost of an
undisturbed step on a machine shared with other jobs (a median follows their bursts). EOS is disabled so every row generates exactly ``--new`` tokens. Prompts are the counterfact
task's (context + question), ``--batch`` of them per call.

Models: ``tiny`` = the embedded ``headlab-tiny`` (when its checkpoint exists), ``random`` = the same
architecture with random weights (4 layers, 8 heads over 4 kv heads, hidden 128), ``big`` = a random
Llama with hidden 1024, 8 layers, 16 heads (costs dominated by the model, as on real models).

DeCoRe masks ``--heads`` heads from ``--first-layer`` on; the layers below run once for both copies
(``share_trunk``). Rows "heads from layer 0" and "no shared trunk" show the cost without that saving.

Targets (issue [decoding]): DoLa <= 1.2x greedy, DeCoRe <= 1.3x greedy.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _tiny_train():
    """tools/tiny/train.py (headlab-tiny's architecture and tokenizer), imported from its file."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "tiny" / "train.py"
    spec = importlib.util.spec_from_file_location("headlab_tiny_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(which: str, device: str = "cpu"):
    import torch

    from headlab.model import load_model
    from headlab.plugin_manager import get_manager
    from headlab.spec import ModelSpec

    if which == "tiny":
        if "headlab-tiny" not in get_manager().components["models"]:
            raise SystemExit("headlab-tiny is not available (no checkpoint); use --model random")
        return load_model(ModelSpec(id="headlab-tiny", device=device))
    train = _tiny_train()
    tok, vocab = train.build_tokenizer()
    cfg = {"model_type": "llama", **train.MODEL_CONFIG, "vocab_size": len(vocab)}
    if which == "big":
        cfg.update(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=8)
    torch.manual_seed(0)
    lm = load_model(ModelSpec(config=cfg, device=device))
    lm.tokenizer = tok
    return lm


def no_eos(lm) -> None:
    """Make EOS unreachable for the loop (every row then generates exactly max_new_tokens)."""
    lm.model.generation_config.eos_token_id = None
    if lm.tokenizer is not None:
        lm.tokenizer.eos_token = None


def reference_decore_loop(lm, batch, heads, max_new: int) -> None:
    """The reference's structure: one prompt at a time, a base and a masked forward per token, each with
    its own KV cache (masking through headlab's instrumentation for the masked forward)."""
    import torch

    from headlab.instrument import Plan, instrument

    model = lm.model
    plan = Plan().mask_heads(heads, mode="query")
    with torch.no_grad():
        for r in range(batch.size):
            ids = batch.input_ids[r: r + 1, batch.pad[r]:]
            base = model(input_ids=ids, use_cache=True)
            with instrument(model, plan):
                masked = model(input_ids=ids, use_cache=True)
                for _ in range(max_new):
                    lb, lmk = base.logits[:, -1].float(), masked.logits[:, -1].float()
                    p = lb.softmax(-1)
                    a = -(p * torch.log(p + 1e-12)).sum(-1, keepdim=True)
                    nxt = ((1 + a) * lb.log_softmax(-1) - a * lmk.log_softmax(-1)).argmax(-1, keepdim=True)
                    masked = model(input_ids=nxt, cache=masked.cache, use_cache=True)
                    with instrument(model, Plan()):
                        base = model(input_ids=nxt, cache=base.cache, use_cache=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "random", "big"], default="random")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (every step ends in a host sync)")
    ap.add_argument("--heads", type=int, default=8, help="number of heads DeCoRe masks")
    ap.add_argument("--first-layer", type=int, default=None,
                    help="the shallowest layer with a masked head (default: 6/32 of the depth, where the "
                         "shallowest of Llama-2-7B-80K's top-10 retrieval heads lies, Wu et al. 2024)")
    args = ap.parse_args()

    import torch

    from headlab.context import TaskContext
    from headlab.generation import DecodeRequest, Rows, decode_loop, tokenize
    from headlab.plugins.decoding.contrastive import CAD, Contrastive, cad, contrastive
    from headlab.plugins.decoding.decore import DeCoRe, decore
    from headlab.plugins.decoding.dola import DoLa, dola
    from headlab.plugins.decoding.greedy import Greedy, Sample, greedy, sample
    from headlab.plugins.tasks.synthetic_tasks import Counterfact, build_counterfact

    torch.set_num_threads(args.threads)
    lm = load(args.model, args.device)
    no_eos(lm)
    examples = build_counterfact(Counterfact(n=args.batch), TaskContext(lm.tokenizer, 0, 0))
    batch = tokenize(lm, examples)
    geo = lm.geometry
    n_layers = geo.n_layers
    first = round(6 / 32 * n_layers) if args.first_layer is None else args.first_layer
    heads = [(layer, head) for layer in range(first, n_layers) for head in range(geo.n_heads)][1::3][: args.heads]
    heads_0 = [(layer, head) for layer in range(n_layers) for head in range(geo.n_heads)][1::3][: args.heads]
    amateur_cfg = {"config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "vocab_size": int(lm.model.config.vocab_size)}}
    strategies = {
        "greedy": (greedy, Greedy()),
        "sample": (sample, Sample(temperature=0.8, top_p=0.9)),
        "dola (high)": (dola, DoLa()),
        "dola (all layers)": (dola, DoLa(layers=list(range(n_layers)))),
        "decore (entropy)": (decore, DeCoRe(heads=[list(h) for h in heads], alpha="entropy")),
        "decore (masked prefix)": (decore, DeCoRe(heads=[list(h) for h in heads], prefix="masked")),
        "decore (heads from layer 0)": (decore, DeCoRe(heads=[list(h) for h in heads_0], alpha="entropy")),
        "decore (no shared trunk)": (decore, DeCoRe(heads=[list(h) for h in heads], alpha="entropy",
                                                    share_trunk=False)),
        "cad": (cad, CAD()),
        "contrastive (1-layer amateur)": (contrastive, Contrastive(amateur=amateur_cfg)),
    }

    def greedy_rows(cfg, request):  # the floor of any 2-copy contrast: greedy over 2B forward rows
        rows = Rows(request.batch.input_ids.repeat(2, 1), request.batch.attention_mask.repeat(2, 1))
        return decode_loop(request, lambda out, _: out.logits[: request.batch.size, -1].argmax(-1), rows=rows)

    strategies["greedy over 2B rows (floor)"] = (greedy_rows, None)

    stamps: list[float] = []
    lm.model.register_forward_pre_hook(lambda *_: stamps.append(time.perf_counter()))

    def step_times(fn, cfg) -> list[float]:
        """Seconds between consecutive forward calls of one decode (one step: forward + choice), the
        prefill and the first step left out."""
        stamps.clear()
        fn(cfg, DecodeRequest(lm, batch, args.new))
        return [b - a for a, b in zip(stamps[2:], stamps[3:], strict=False)]

    for fn, cfg in strategies.values():  # warm-up (allocator, amateur load)
        step_times(fn, cfg)
    per_token: dict[str, list[float]] = {k: [] for k in strategies}
    for _ in range(args.reps):
        for name, (fn, cfg) in strategies.items():
            per_token[name].extend(step_times(fn, cfg))
    # the 10th percentile of the step times: a step undisturbed by the other jobs of a shared machine
    med = {k: statistics.quantiles(v, n=10)[0] for k, v in per_token.items()}
    print(f"model {args.model} ({geo.n_layers} layers, {geo.n_heads} heads, vocab {lm.model.config.vocab_size}), "
          f"batch {args.batch}, prompt {batch.length} tokens, {args.new} new tokens, threads {args.threads}, "
          f"DeCoRe masks {len(heads)} heads from layer {first} on")
    print(f"{'strategy':32s} {'ms/token (batch)':>18s} {'x greedy':>9s}")
    for name, v in med.items():
        print(f"{name:32s} {1000 * v:18.2f} {v / med['greedy']:9.2f}")

    # DeCoRe batched vs the reference-style loop, same prompts and tokens
    times_b, times_r = [], []
    cfg = DeCoRe(heads=[list(h) for h in heads], alpha="entropy", prefix="masked")
    for _ in range(args.reps):
        t = time.perf_counter()
        decore(cfg, DecodeRequest(lm, batch, args.new))
        times_b.append(time.perf_counter() - t)
        t = time.perf_counter()
        reference_decore_loop(lm, batch, heads, args.new)
        times_r.append(time.perf_counter() - t)
    b, r = min(times_b), min(times_r)
    print(f"DeCoRe batched (one forward, {2 * args.batch} rows): {b:.3f} s; reference-style loop (batch 1, "
          f"two forwards per token): {r:.3f} s; speed-up {r / b:.2f}x")


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
