"""Measure what ``headlab-tiny`` can do, and which of its heads do it.

Standalone (transformers + torch only, no headlab engine). Usage::

    python tools/tiny/evaluate.py [--model DIR] [--quick] [--out DIR/eval.json]

Measures and prints (and writes ``eval.json`` next to the checkpoint):

- needle recall by context length x depth (greedy decoding; an answer counts when the ROUGE-1 recall of
  the generated text against the expected answer is > 0.5), including lengths beyond training;
- accuracy per task: key-value retrieval by number of pairs, repeated-sequence copying by length
  (continue the second copy), closed-book facts, context-faithful rate on counterfactual contexts under
  greedy decoding (plus the same rate under CAD, alpha 0.5, to show the room contrastive decoding has),
  emphasis task (recency answer on the plain prompt; first-statement answer when the emphasis is said in
  plain text; first-statement answer under PASTA on the best layer);
- induction score per head on random words repeated twice, several lengths, from eager attention:
  ``induction`` = mean attention of second-copy queries on the token after the previous occurrence
  (the classic score), and ``induction_tl`` = TransformerLens ``head_detector`` "mul" score
  ``sum(A * D) / sum(A)`` over the whole sequence (at most about 0.5 for a sequence repeated twice);
- retrieval score per head (docs/methods.md#retrieval-score; Wu et al. 2024): at each greedy decode step, the top-1 key of
  each head's attention row lands in the needle span and the attended prompt token equals the generated
  token -> +1/(needle length in tokens); mean over instances where the needle was retrieved.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from headlab.plugins.tasks import generators as S

HERE = Path(__file__).resolve().parent
CHECKPOINTS = HERE.parents[1] / "headlab" / "plugins" / "models" / "tiny"  # where the embedded checkpoints ship
DEFAULT_MODEL = CHECKPOINTS / "headlab-tiny"




def load(model_dir: Path, attn: str = "eager"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn)
    model.eval()
    return model, tok


# ----------------------------------------------------------------------------------------------------
# Greedy decoding with per-step attention rows
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy(model, ids: list[int], max_new: int = 16, eos: int = 2, want_attn: bool = False,
           bias_fn=None):
    """Greedy decode one prompt. Returns (generated ids, per step [L, H, keys] top-1 key indices or None).

    The prompt minus its last token is prefilled without attention outputs; each decode step feeds one
    token and reads that query's attention row in every layer and head.
    """
    from transformers import DynamicCache

    inp = torch.tensor([ids])
    cache = DynamicCache()
    impl = model.config._attn_implementation
    fast_prefill = want_attn and impl == "eager"
    try:
        if inp.shape[1] > 1:
            if fast_prefill:  # the prefill needs no attention weights: use SDPA, then eager to decode
                model.set_attn_implementation("sdpa")
            model(input_ids=inp[:, :-1], cache=cache, use_cache=True)
            if fast_prefill:
                model.set_attn_implementation(impl)
        cur = inp[:, -1:]
        out, tops = [], []
        for _ in range(max_new):
            o = model(input_ids=cur, cache=cache, use_cache=True, output_attentions=want_attn)
            nxt = int(o.logits[0, -1].argmax())
            if want_attn:
                tops.append(torch.stack([a[0, :, -1].argmax(-1) for a in o.attentions]))  # [L, H]
            if nxt == eos:
                break
            out.append(nxt)
            cur = torch.tensor([[nxt]])
    finally:
        if model.config._attn_implementation != impl:
            model.set_attn_implementation(impl)
    return out, tops


def span_to_tokens(offsets, span) -> tuple[int, int]:
    """Token range [s, e) of the tokens lying inside the character span (BOS, offset (0,0), skipped)."""
    s, e = span
    idx = [i for i, (a, b) in enumerate(offsets) if b > a and a >= s and b <= e]
    return (idx[0], idx[-1] + 1) if idx else (0, 0)


# ----------------------------------------------------------------------------------------------------
# Needle in a haystack + retrieval score
# ----------------------------------------------------------------------------------------------------


def eval_niah(model, tok, lengths, depths, seed=0):
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    examples = S.niah(lengths, depths, seed=seed, length_fn=lambda s: len(tok(s, add_special_tokens=False).input_ids))
    grid: dict = {}
    score_sum = torch.zeros(L, H)
    counted = 0
    per_instance = []
    t0 = time.time()
    for i, ex in enumerate(examples):
        if i % 30 == 0:
            print(f"  niah {i}/{len(examples)} ({time.time() - t0:.0f}s)", flush=True)
        enc = tok(ex["prompt"], return_offsets_mapping=True)
        ids = enc["input_ids"]
        s, e = span_to_tokens(enc["offset_mapping"], ex["needle_span"])
        gen, tops = greedy(model, ids, max_new=16, want_attn=True)
        text = tok.decode(gen, skip_special_tokens=True)
        rec = S.rouge1_recall(text, ex["answer"])
        ok = rec > 0.5
        key = (ex["context_length"], round(ex["depth"], 3))
        grid.setdefault(key, []).append(ok)
        if ok:
            sc = torch.zeros(L, H)
            for t, top in enumerate(tops[: len(gen)]):
                w = gen[t]
                hit = (top >= s) & (top < e)
                tok_ok = torch.tensor(ids)[top.clamp(max=len(ids) - 1)] == w
                sc += (hit & tok_ok & (top < len(ids))).float() / max(1, e - s)
            score_sum += sc
            counted += 1
            per_instance.append(sc)
    recall_by_len = {}
    for (Lc, _d), oks in grid.items():
        recall_by_len.setdefault(Lc, []).extend(oks)
    table = {
        str(Lc): {str(d): sum(grid[(Lc, d)]) / len(grid[(Lc, d)]) for (L2, d) in grid if L2 == Lc}
        for Lc in sorted(recall_by_len)
    }
    retrieval = score_sum / max(1, counted)
    return {
        "recall_by_length": {str(k): sum(v) / len(v) for k, v in sorted(recall_by_len.items())},
        "recall_by_length_depth": table,
        "recall_overall": sum(sum(v) for v in recall_by_len.values()) / len(examples),
        "n_examples": len(examples),
        "retrieval_counted_instances": counted,
        "retrieval_scores": retrieval.tolist(),
    }


# ----------------------------------------------------------------------------------------------------
# Other tasks
# ----------------------------------------------------------------------------------------------------


def gen_text(model, tok, prompt, max_new=12):
    gen, _ = greedy(model, tok(prompt)["input_ids"], max_new=max_new)
    return tok.decode(gen, skip_special_tokens=True).strip()


def eval_kv(model, tok, sizes, n=30, seed=1):
    res = {}
    for m in sizes:
        exs = S.kv_retrieval(n, [m], seed=seed + m)
        res[str(m)] = sum(gen_text(model, tok, ex["prompt"], 4) == ex["answer"] for ex in exs) / len(exs)
    return res


def eval_copy(model, tok, lengths, n=10, seed=2, prefix_tokens=0):
    """Give the first copy and the first token of the second; exact match of the continued copy.

    ``prefix_tokens`` > 0 puts that much filler text before the first copy (as in training, where repeats
    sit inside text); 0 puts the first copy right after BOS."""
    res = {}
    for length in lengths:
        exs = S.repeated_tokens([length], n, seed=seed + length)
        ok = 0
        tokacc = tf = 0.0
        for i, ex in enumerate(exs):
            w = ex["words"]
            prompt = " ".join(w[: length + 1])
            if prefix_tokens:
                prompt = S.filler_text(prefix_tokens, seed + i) + " " + prompt
            ids = tok(prompt)["input_ids"]
            gen, _ = greedy(model, ids, max_new=length - 1 + 1)
            ref = tok(" ".join(w[length + 1:]), add_special_tokens=False)["input_ids"]
            full = tok(prompt + " " + " ".join(w[length + 1:]))["input_ids"]
            with torch.no_grad():
                pred = model(input_ids=torch.tensor([full])).logits[0, :-1].argmax(-1)
            tf += float((pred[-len(ref):] == torch.tensor(full[-len(ref):])).float().mean())
            m = sum(int(a == b) for a, b in zip(gen, ref, strict=False))
            tokacc += m / len(ref)
            ok += int(gen[: len(ref)] == ref)
        res[str(length)] = {"exact": ok / n, "token_acc": tokacc / n, "teacher_forced_acc": tf / n}
    return res


@torch.no_grad()
def first_logits(model, tok, prompt):
    return model(input_ids=torch.tensor([tok(prompt)["input_ids"]])).logits[0, -1]


def eval_facts(model, tok, alpha=0.5):
    cb = S.closed_book()
    closed = sum(gen_text(model, tok, ex["prompt"], 3) == ex["answer"] for ex in cb) / len(cb)
    out = {"closed_book_accuracy": closed}
    for conflict in (True, False):
        exs = S.counterfact(2 * len(S.FACTS), conflict=conflict, seed=7 if conflict else 8)
        stats = {"all": [0, 0, 0, 0], "strong": [0, 0, 0, 0], "weak": [0, 0, 0, 0]}
        for ex in exs:
            lc = first_logits(model, tok, ex["prompt"])
            g = tok.decode([int(lc.argmax())]).strip()
            ln = first_logits(model, tok, ex["question"])
            cad = (1 + alpha) * lc.log_softmax(-1) - alpha * ln.log_softmax(-1)
            gc = tok.decode([int(cad.argmax())]).strip()
            for k in ("all", ex["strength"]):
                stats[k][0] += int(g == ex["context_answer"])
                stats[k][1] += int(g == ex["memory_answer"])
                stats[k][2] += int(gc == ex["context_answer"])
                stats[k][3] += 1
        name = "conflict" if conflict else "agreeing"
        out[name] = {
            k: {"context_faithful_greedy": v[0] / v[3], "memory_greedy": v[1] / v[3],
                "context_faithful_cad": v[2] / v[3], "n": v[3]}
            for k, v in stats.items() if v[3]
        }
    return out


def eval_emphasis(model, tok, n=60, pasta=True):
    exs = S.emphasis(n, seed=11)
    rec = sum(gen_text(model, tok, ex["prompt"], 3) == ex["default_answer"] for ex in exs) / n
    plain = sum(gen_text(model, tok, ex["plain_emphasis_prompt"], 3) == ex["emphasis_answer"] for ex in exs) / n
    out = {"recency_accuracy_plain_prompt": rec, "first_statement_rate_plain_text_emphasis": plain}
    if pasta:
        out["pasta"] = eval_pasta(model, tok, exs)
    return out


# A minimal PASTA for this evaluation only (docs/methods.md#pasta: add log(alpha) to the pre-softmax scores of the
# non-emphasised prompt keys, on the steered heads). headlab's steering plugin is the real implementation.
_PASTA: dict = {}


def _pasta_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    bias = _PASTA.get("bias")
    heads = _PASTA.get("heads", {}).get(module.layer_idx)
    if bias is not None and heads:
        Lk = key.shape[2]
        b = torch.zeros(1, query.shape[1], 1, Lk)
        n = min(Lk, bias.shape[0])
        for h in heads:
            b[0, h, 0, :n] = bias[:n]
        attention_mask = b if attention_mask is None else attention_mask + b
    return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                   dropout=dropout, **kwargs)


def eval_pasta(model, tok, exs, alphas=(0.01, 1e-6)):
    return {f"alpha={a:g}": _eval_pasta(model, tok, exs, a) for a in alphas}


def _eval_pasta(model, tok, exs, alpha):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("pasta_eval", _pasta_attention)
    AttentionMaskInterface.register("pasta_eval", eager_mask)  # else the function gets no causal mask
    prev = model.config._attn_implementation
    model.set_attn_implementation("pasta_eval")
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    res = {}
    try:
        configs = {f"layer{li}": {li: list(range(H))} for li in range(L)}
        configs["all"] = {li: list(range(H)) for li in range(L)}
        for name, heads in configs.items():
            first = rec = 0
            for ex in exs:
                enc = tok(ex["prompt"], return_offsets_mapping=True)
                ids = enc["input_ids"]
                s, e = span_to_tokens(enc["offset_mapping"], ex["emphasis_spans"][0])
                bias = torch.full((len(ids),), math.log(alpha))
                bias[s:e] = 0.0
                _PASTA.update(bias=bias, heads=heads)
                gen, _ = greedy(model, ids, max_new=3)
                _PASTA.clear()
                g = tok.decode(gen, skip_special_tokens=True).strip()
                first += int(g == ex["emphasis_answer"])
                rec += int(g == ex["default_answer"])
            res[name] = {"first_statement_rate": first / len(exs), "recency_rate": rec / len(exs)}
    finally:
        _PASTA.clear()
        model.set_attn_implementation(prev)
    return res


# ----------------------------------------------------------------------------------------------------
# Induction scores
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def induction_scores(model, tok, lengths, n=4, seed=3):
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    res = {}
    for length in lengths:
        classic = torch.zeros(L, H)
        tl = torch.zeros(L, H)
        for ex in S.repeated_tokens([length], n, seed=seed + length):
            ids = tok(ex["text"])["input_ids"]
            T = len(ids)
            att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
            A = torch.stack([a[0] for a in att])  # [L, H, T, T]
            t = torch.tensor(ids)
            # TransformerLens induction pattern: D[i, j] = 1 iff tok[j-1] == tok[i], j-1 < i
            dup = (t[:, None] == t[None, :]) & (torch.arange(T)[None, :] < torch.arange(T)[:, None])
            D = torch.zeros(T, T)
            D[:, 1:] = dup[:, :-1].float()
            D = torch.tril(D)
            tl += (A * D).sum((-1, -2)) / A.sum((-1, -2))
            # classic: second-copy queries i (token positions 1+length .. 2*length) attend i - length + 1
            q = torch.arange(1 + length, 1 + 2 * length)
            k = q - length + 1
            classic += A[:, :, q, k].mean(-1)
        res[str(length)] = {"induction": (classic / n).tolist(), "induction_tl": (tl / n).tolist()}
    return res


# ----------------------------------------------------------------------------------------------------


def fmt_heads(mat, thr, top=8):
    t = torch.tensor(mat)
    H = t.shape[1]
    order = t.flatten().argsort(descending=True)[:top]
    return ", ".join(f"{int(i) // H}-{int(i) % H}:{float(t.flatten()[i]):.2f}" for i in order) + \
        f"  (>= {thr}: {int((t >= thr).sum())}/{t.numel()})"


def to_markdown(res: dict) -> str:
    """The measured tables, as in docs/model-card.md."""
    lines = []
    nia = res["niah"]
    lens = list(nia["recall_by_length_depth"])
    depths = list(next(iter(nia["recall_by_length_depth"].values())))
    lines.append("Needle recall (ROUGE-1 recall > 0.5, greedy), context length (tokens) x needle depth:\n")
    lines.append("| length | " + " | ".join(f"{float(d):.2f}" for d in depths) + " | mean |")
    lines.append("|---" * (len(depths) + 2) + "|")
    for L in lens:
        row = nia["recall_by_length_depth"][L]
        lines.append(f"| {L} | " + " | ".join(f"{row[d]:.2f}" for d in depths)
                     + f" | **{nia['recall_by_length'][L]:.2f}** |")
    lines.append(f"\nOverall {nia['recall_overall']:.3f} over {nia['n_examples']} prompts.\n")
    lines.append("Key-value retrieval accuracy (exact match) by number of pairs:\n")
    kv = res["kv_accuracy_by_pairs"]
    lines.append("| pairs | " + " | ".join(kv) + " |")
    lines.append("|---" * (len(kv) + 1) + "|")
    lines.append("| accuracy | " + " | ".join(f"{v:.2f}" for v in kv.values()) + " |\n")
    for key, where in (("copy_by_length", "after 20 filler tokens"), ("copy_by_length_after_bos", "right after BOS")):
        if key not in res:
            continue
        cp = res[key]
        lines.append(f"Copying a repeated random sequence ({where}; given one copy and the first token of the "
                     "second, greedy):\n")
        lines.append("| length | " + " | ".join(cp) + " |")
        lines.append("|---" * (len(cp) + 1) + "|")
        lines.append("| exact | " + " | ".join(f"{v['exact']:.2f}" for v in cp.values()) + " |")
        lines.append("| token accuracy (free-running) | " + " | ".join(f"{v['token_acc']:.2f}" for v in cp.values()) + " |")
        lines.append("| next-token accuracy (teacher-forced) | "
                     + " | ".join(f"{v['teacher_forced_acc']:.2f}" for v in cp.values()) + " |\n")
    f = res["facts"]
    lines.append(f"Closed-book facts: accuracy {f['closed_book_accuracy']:.2f} on the {len(S.FACTS)} capitals.\n")
    lines.append("Counterfactual contexts (first answer token; CAD alpha 0.5):\n")
    lines.append("| contexts | facts | context-faithful (greedy) | memory (greedy) | context-faithful (CAD) | n |")
    lines.append("|---|---|---|---|---|---|")
    for kind in ("conflict", "agreeing"):
        for k, v in f[kind].items():
            lines.append(f"| {kind} | {k} | {v['context_faithful_greedy']:.2f} | {v['memory_greedy']:.2f} | "
                         f"{v['context_faithful_cad']:.2f} | {v['n']} |")
    e = res["emphasis"]
    lines.append("\nEmphasis (two conflicting statements, the later one wins by training):\n")
    lines.append(f"- recency answer on the plain prompt: {e['recency_accuracy_plain_prompt']:.2f}")
    lines.append(f"- first-statement answer when a sentence says the first statement is right: "
                 f"{e['first_statement_rate_plain_text_emphasis']:.2f}")
    if "pasta" in e:
        lines.append("- PASTA on the first statement (all heads of one layer, scale_position exclude):\n")
        lines.append("| alpha | steered | first-statement answer | recency answer |")
        lines.append("|---|---|---|---|")
        for a, per in e["pasta"].items():
            for k, v in per.items():
                lines.append(f"| {a.split('=')[1]} | {k} | {v['first_statement_rate']:.2f} | {v['recency_rate']:.2f} |")
    lines.append("\nInduction scores per head (layer-head), top 6, per repeat length:\n")
    lines.append("| length | classic (second-copy mean) | heads >= 0.3 | TransformerLens mul | heads >= 0.2 |")
    lines.append("|---|---|---|---|---|")
    for L, v in res["induction"].items():
        lines.append(f"| {L} | {fmt_heads(v['induction'], 0.3, 6).split('  (')[0]} | "
                     f"{int((torch.tensor(v['induction']) >= 0.3).sum())} | "
                     f"{fmt_heads(v['induction_tl'], 0.2, 6).split('  (')[0]} | "
                     f"{int((torch.tensor(v['induction_tl']) >= 0.2).sum())} |")
    r = torch.tensor(nia["retrieval_scores"])
    lines.append(f"\nRetrieval scores (Wu et al.; {nia['retrieval_counted_instances']} retrieved instances): "
                 f"top heads {fmt_heads(nia['retrieval_scores'], 0.1, 8).split('  (')[0]}; "
                 f"{int((r >= 0.1).sum())} of {r.numel()} heads >= 0.1.\n")
    lines.append("Per-head matrices (rows = layers, columns = heads):\n")
    for name, mat in [("retrieval", nia["retrieval_scores"]),
                      ("induction (classic, longest length)", list(res["induction"].values())[-1]["induction"])]:
        lines.append(f"{name}:\n```")
        for li, row in enumerate(mat):
            lines.append(f"L{li}: " + " ".join(f"{x:5.2f}" for x in row))
        lines.append("```")
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> str:
    """``path`` as recorded in eval.json: relative to the repository when inside it, else as given."""
    root = HERE.parents[1]
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        return str(path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--out", type=Path, default=None, help="default: <model>/eval.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load(args.model)
    t0 = time.time()
    if args.quick:
        lengths, depths = [256, 1024], [0.0, 0.5, 1.0]
        kv_sizes, copy_lens, ind_lens = [8, 32], [20, 100], [20, 100]
    else:
        lengths = [128, 256, 512, 1024, 1536, 2048, 3072]
        depths = [i / 9 for i in range(10)]
        kv_sizes = [4, 8, 16, 32, 64, 96]
        copy_lens = [10, 50, 200, 1000, 1500]
        ind_lens = [10, 50, 200, 500, 1000]
    res: dict = {"model": _shown(args.model), "trained_max_length": 2048}

    def show(name, obj):
        print(f"== {name} ({time.time() - t0:.0f}s)\n{json.dumps(obj, indent=1)[:3000]}", flush=True)

    res["niah"] = eval_niah(model, tok, lengths, depths)
    show("niah recall by length", res["niah"]["recall_by_length"])
    res["kv_accuracy_by_pairs"] = eval_kv(model, tok, kv_sizes)
    show("kv accuracy by number of pairs", res["kv_accuracy_by_pairs"])
    res["copy_by_length"] = eval_copy(model, tok, copy_lens, n=6, prefix_tokens=20)
    show("copy (second copy, after 20 filler tokens) by length", res["copy_by_length"])
    res["copy_by_length_after_bos"] = eval_copy(model, tok, copy_lens[:3], n=6)
    show("copy (second copy, right after BOS) by length", res["copy_by_length_after_bos"])
    res["facts"] = eval_facts(model, tok)
    show("facts / counterfact", res["facts"])
    res["emphasis"] = eval_emphasis(model, tok)
    show("emphasis", res["emphasis"])
    res["induction"] = induction_scores(model, tok, ind_lens)
    for length, v in res["induction"].items():
        print(f"induction (classic) len {length}: {fmt_heads(v['induction'], 0.3)}")
        print(f"induction (TL mul)  len {length}: {fmt_heads(v['induction_tl'], 0.2)}")
    print(f"retrieval: {fmt_heads(res['niah']['retrieval_scores'], 0.1)}")
    res["seconds"] = round(time.time() - t0, 1)
    out = args.out or (args.model / "eval.json")
    out.write_text(json.dumps(res, indent=1) + "\n")
    md = to_markdown(res)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out} and {out.with_suffix('.md')} ({res['seconds']}s)")


if __name__ == "__main__":
    main()
