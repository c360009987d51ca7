"""Train ``headlab-tiny``: a small Llama whose retrieval and induction heads are real.

CPU only, seeded, about 50 minutes on 2 cores. Usage (from the repository root)::

    python tools/tiny/train.py              # writes headlab/plugins/models/tiny/headlab-tiny
    python tools/tiny/train.py --quick      # a 2-minute smoke run into /tmp

What it does
------------
1. Builds a word-level tokenizer (``tokenizers`` WordLevel, whitespace+punctuation pre-tokenizer, one
   token per word or punctuation mark) from :func:`synthetic.vocabulary`, with ``<pad>=0, <bos>=1,
   <eos>=2, <unk>=3``; a BOS is prepended by the post-processor. Saved as a fast tokenizer.
2. Trains ``LlamaForCausalLM`` (rope, GQA: 8 query heads over 4 key/value heads) on packed rows. Each
   row holds one long episode (needle in a haystack, key-value retrieval, or a random sequence repeated
   at a random position and length) plus short episodes (closed-book facts, counterfactual contexts,
   emphasis/recency statements), each ending with ``<eos>``.
3. Loss per task group: mean cross-entropy over that group's supervised tokens (answer tokens only for
   QA tasks; the second copy for repeated sequences; every token of the filler at a low weight), summed
   with weights, so that short answers are not swamped by long copy targets.
4. A curriculum over row length: 128 -> 256 -> 512 -> 1024 -> 2048 tokens at about 4K tokens a step, then
   1600 steps at 2048 tokens that favour needles far from the question.
   Each stage ends with a checkpoint in ``--work-dir``; ``--resume`` continues from the last one.
5. Saves the model (safetensors), tokenizer and generation config to ``--out``
   (default ``headlab/plugins/models/tiny/headlab-tiny``).

Context vs memory: the facts table is split into "strong" and "weak" facts (:data:`STRONG_COUNTRIES`).
On a contradicting context, the training target is the memorised capital 75% of the time for strong
facts and the context's answer 90% of the time for weak ones, so greedy decoding follows the context on
about half of the conflicts and contrastive decoding (CAD, DeCoRe) has room to raise that rate.

Emphasis: two conflicting "X lives in A / B" statements, the later wins; sentences that say the first
statement is right appear in training and are ignored (the target stays the later statement).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from headlab.plugins.tasks import generators as S

HERE = Path(__file__).resolve().parent
CHECKPOINTS = HERE.parents[1] / "headlab" / "plugins" / "models" / "tiny"  # where the embedded checkpoints ship
DEFAULT_OUT = CHECKPOINTS / "headlab-tiny"



SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD, BOS, EOS, UNK = 0, 1, 2, 3

GROUPS = ["lm", "niah", "kv", "ind", "fact", "cf", "emph"]
WEIGHTS = {"lm": 0.3, "niah": 2.0, "kv": 2.0, "ind": 2.0, "fact": 1.0, "cf": 1.0, "emph": 1.0}
NO_LOSS = -1

MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    initializer_range=0.02,
)

# (row length, batch size, steps[, options]). Options: "long" (niah, kv, induction row mix), "far" (the
# fraction of niah rows whose episode fills 70-92% of the row with the needle in its first 40%),
# "shorts" (max short QA episodes per row), "until_ind" (end the stage early once the running induction
# loss drops below this: induction heads form in a phase change after a plateau, here ~500 steps).
# Stage 0 is a pure repeated-sequence warm-up (varied lengths and positions, so only content-based
# induction solves it); the facts/QA mixture starts once induction heads exist.
STAGES = [
    (64, 32, 1500, {"long": [0, 0, 1], "shorts": 0, "until_ind": 1.0}),
    (128, 32, 400),
    (256, 16, 300),
    (512, 8, 300),
    (1024, 4, 200),
    (2048, 2, 150),
    (2048, 2, 150, {"lr": 4e-4}),  # longer contexts need more steps: a second cosine at 2K
    # far needles: after the stages above, recall at 2K failed when the needle sat >~800 tokens before the
    # question (rare in the mix); these stages fill most of the row with the niah episode and put the needle
    # in the first 40% ("far") in a fraction of rows, then rebalance depths
    (2048, 2, 200, {"lr": 3e-4, "long": [0.7, 0.1, 0.2], "far": 0.6}),
    (2048, 2, 600, {"lr": 4e-4, "long": [0.7, 0.1, 0.2], "far": 0.7}),
    (2048, 2, 800, {"lr": 3e-4, "long": [0.6, 0.15, 0.25], "far": 0.35}),
]
QUICK_STAGES = [(64, 32, 150, {"long": [0, 0, 1], "shorts": 0}), (128, 16, 100)]


# ----------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------


def build_tokenizer():
    """A fast word-level tokenizer over the synthetic vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [w for w in S.vocabulary() if w not in SPECIALS]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # \w+|[^\w\s]+, the same split as synthetic.py
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # join with spaces, tidy punctuation
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    return fast, vocab


class Encoder:
    """Fast text -> ids for training (identical to the tokenizer for in-vocabulary text)."""

    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def __call__(self, text: str) -> list[int]:
        v = self.vocab
        return [v.get(w, UNK) for w in S.tokenize_words(text)]


# ----------------------------------------------------------------------------------------------------
# Episodes: each returns a list of (ids, group or None)
# ----------------------------------------------------------------------------------------------------


class Data:
    def __init__(self, enc: Encoder, seed: int, long_weights=(0.4, 0.25, 0.35), short_weights=(0.3, 0.45, 0.25),
                 max_shorts: int = 64):
        self.long_weights = list(long_weights)
        self.short_weights = list(short_weights)
        self.max_shorts = max_shorts
        self.far = 0.0
        self.enc = enc
        self.rng = random.Random(seed)
        self.hay = S.haystack_text()
        self.hay_spans = S.token_spans(self.hay)
        self.rand_pool = [i for w, i in enc.vocab.items() if w not in SPECIALS]
        self.facts = list(S.FACTS)

    # long episodes -------------------------------------------------------------------------------
    def niah(self, n_tok: int, far: bool = False):
        rng = self.rng
        needle, question, answer = S.random_needle(rng)
        if far:
            d = rng.uniform(0.0, 0.4)
        else:
            d = rng.random() if rng.random() < 0.8 else rng.choice([0.0, 1.0])
        ex = S.niah_example(
            self.hay, self.hay_spans, max(16, n_tok - 12), d, needle, question, answer, S.count_tokens,
            rng, 1 if rng.random() < 0.3 else 0, True, -1,
        )
        return [(self.enc(ex["prompt"]), "lm"), (self.enc(ex["target"]) + [EOS], "niah")]

    def kv(self, n_tok: int):
        rng = self.rng
        m = max(2, min(len(S.KEYS), (n_tok - 4) // 5))
        m = rng.randint(2, m)
        ex = S.kv_example(rng, m, (1, 2))
        return [(self.enc(ex["prompt"]), None), (self.enc(ex["target"]) + [EOS], "kv")]

    def induction(self, n_tok: int):
        rng = self.rng
        n_tok = max(12, n_tok)
        n = rng.randint(3, max(3, (n_tok - 2) // 2))
        rest = max(0, n_tok - 2 * n)
        pre_len = rng.randint(0, rest)
        gap_len = rng.randint(0, rest - pre_len) if rng.random() < 0.5 else 0
        seq = [rng.choice(self.rand_pool) for _ in range(n)]
        out = []
        if pre_len:
            out.append((self.enc(S.filler_text(pre_len, rng)), "lm"))
        out.append((seq, None))
        if gap_len:
            out.append((self.enc(S.filler_text(gap_len, rng)), "lm"))
        out.append((seq[:1], None))
        out.append((seq[1:] + [EOS], "ind"))
        return out

    # short episodes ------------------------------------------------------------------------------
    def fact(self, used: set):
        c, a = self._fact(used)
        pre = S.filler_sentence(self.rng) + " " if self.rng.random() < 0.3 else ""
        return [(self.enc(f"{pre}Question: What is the capital of {c}? Answer:"), None),
                (self.enc(" " + a) + [EOS], "fact")]

    def cf(self, used: set):
        rng = self.rng
        c, mem = self._fact(used)
        r = rng.random()
        if r < 0.25:  # agreeing context
            ex = S.counterfact(1, facts=[(c, mem)], conflict=False, seed=rng.randrange(1 << 30))[0]
            tgt = mem
        else:
            ex = S.counterfact(1, facts=[(c, mem)], conflict=True, seed=rng.randrange(1 << 30))[0]
            if c in S.STRONG_COUNTRIES:
                tgt = mem if rng.random() < 0.75 else ex["context_answer"]
            else:
                tgt = ex["context_answer"] if rng.random() < 0.9 else mem
        return [(self.enc(ex["prompt"]), None), (self.enc(" " + tgt) + [EOS], "cf")]

    def emph(self, used: set):
        rng = self.rng
        while True:
            ex = S.emphasis(1, seed=rng.randrange(1 << 30))[0]
            if ex["name"] not in used:
                used.add(ex["name"])
                break
        prompt = ex["plain_emphasis_prompt"] if rng.random() < 0.3 else ex["prompt"]
        return [(self.enc(prompt), None), (self.enc(" " + ex["default_answer"]) + [EOS], "emph")]

    def _fact(self, used: set):
        while True:
            c, a = self.rng.choice(self.facts)
            if c not in used:
                used.add(c)
                return c, a

    # rows ----------------------------------------------------------------------------------------
    def row(self, T: int):
        rng = self.rng
        kind = rng.choices(["niah", "kv", "ind"], weights=self.long_weights)[0]
        if kind == "niah" and rng.random() < self.far:
            episodes = [self.niah(rng.randint(int(T * 0.7), int(T * 0.92)), far=True)]
        else:
            long_len = rng.randint(max(16, T // 8), max(24, int(T * 0.85)))
            episodes = [getattr(self, {"niah": "niah", "kv": "kv", "ind": "induction"}[kind])(long_len)]
        total = sum(len(ids) for e in episodes for ids, _ in e) + 1
        used: set = set()
        shorts = []
        for _ in range(self.max_shorts):
            f = rng.choices([self.fact, self.cf, self.emph], weights=self.short_weights)[0]
            ep = f(used)
            n = sum(len(ids) for ids, _ in ep)
            if total + n > T:
                break
            shorts.append(ep)
            total += n
        episodes += shorts
        rng.shuffle(episodes)
        ids = [BOS]
        grp = [NO_LOSS]
        for ep in episodes:
            for seg, g in ep:
                ids += seg
                grp += [GROUPS.index(g) if g else NO_LOSS] * len(seg)
        return ids[:T], grp[:T]

    def batch(self, T: int, B: int):
        rows = [self.row(T) for _ in range(B)]
        L = max(len(r[0]) for r in rows)
        ids = torch.full((B, L), PAD, dtype=torch.long)
        grp = torch.full((B, L), NO_LOSS, dtype=torch.long)
        att = torch.zeros((B, L), dtype=torch.long)
        for b, (i, g) in enumerate(rows):
            ids[b, : len(i)] = torch.tensor(i)
            grp[b, : len(g)] = torch.tensor(g)
            att[b, : len(i)] = 1
        return ids, grp, att


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------


def group_losses(logits: torch.Tensor, ids: torch.Tensor, grp: torch.Tensor):
    """Per-group mean CE and argmax accuracy; position t predicts token t+1 labelled by grp[t+1]."""
    lg = logits[:, :-1].float()
    tgt = ids[:, 1:]
    g = grp[:, 1:]
    ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1), reduction="none")
    ce = ce.view_as(tgt)
    acc = (lg.argmax(-1) == tgt).float()
    out = {}
    for k, name in enumerate(GROUPS):
        m = g == k
        n = int(m.sum())
        if n:
            out[name] = (ce[m].mean(), float(acc[m].mean()), n)
    return out


def make_model(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **MODEL_CONFIG
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def save_final(model, tok, out: Path, meta: dict) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, do_sample=False, max_new_tokens=24
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/headlab-tiny-train"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared machine")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few minutes into /tmp")
    ap.add_argument("--resume", action="store_true", help="continue from the last stage checkpoint")
    ap.add_argument("--stages", type=str, default=None, help='JSON list of [length, batch, steps]')
    ap.add_argument("--long-weights", type=str, default="0.4,0.25,0.35", help="niah,kv,induction row mix")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--max-shorts", type=int, default=64, help="short QA episodes per row, at most")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    stages = json.loads(args.stages) if args.stages else (QUICK_STAGES if args.quick else STAGES)
    if args.quick and args.out == DEFAULT_OUT:
        args.out = Path("/tmp/headlab-tiny-quick")
    args.work_dir.mkdir(parents=True, exist_ok=True)

    tok, vocab = build_tokenizer()
    vocab_size = int(math.ceil(len(vocab) / 64) * 64)
    model = make_model(vocab_size)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(vocab)} (padded {vocab_size}), params {n_params / 1e6:.2f}M, stages {stages}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    warm = args.warmup
    # lr: linear warm-up, constant through stages that end on a condition, then cosine to 10% over the
    # remaining stages (their step counts are fixed).
    sched = {"decay_start": None, "decay_total": 1}

    def lr_at(step: int) -> float:
        if step < warm:
            return args.lr * (step + 1) / warm
        if sched["decay_start"] is None:
            return args.lr
        p = min(1.0, (step - sched["decay_start"]) / sched["decay_total"])
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    start_stage, step = 0, 0
    ck = args.work_dir / "last.pt"
    if args.resume and ck.exists():
        state = torch.load(ck, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start_stage, step = state["stage"] + 1, state["step"]
        sched.update(state.get("sched", {}))
        print(f"resumed after stage {state['stage']} at step {step}", flush=True)

    default_long = [float(x) for x in args.long_weights.split(",")]
    data = Data(Encoder(vocab), args.seed * 1000 + start_stage, long_weights=default_long,
                max_shorts=args.max_shorts)
    t0 = time.time()
    log = []
    model.train()
    for si in range(start_stage, len(stages)):
        T, B, n_steps = stages[si][:3]
        opts = stages[si][3] if len(stages[si]) > 3 else {}
        data.long_weights = list(opts.get("long", default_long))
        data.max_shorts = int(opts.get("shorts", args.max_shorts))
        data.far = float(opts.get("far", 0.0))
        data.short_weights = list(opts.get("short", (0.3, 0.45, 0.25)))
        until_ind = opts.get("until_ind")
        if until_ind is None and sched["decay_start"] is None:
            sched["decay_start"] = step
            sched["decay_total"] = max(1, sum(st[2] for st in stages[si:]))
        recent_ind: list[float] = []
        agg: dict[str, list] = {}
        ts = time.time()
        for k in range(n_steps):
            if "lr" in opts:  # a stage with its own cosine schedule (used for appended stages)
                lr_now = opts["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / n_steps)))
            else:
                lr_now = lr_at(step)
            for gopt in opt.param_groups:
                gopt["lr"] = lr_now
            ids, grp, att = data.batch(T, B)
            logits = model(input_ids=ids, attention_mask=att).logits
            gl = group_losses(logits, ids, grp)
            loss = sum(WEIGHTS[n] * v[0] for n, v in gl.items())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            for n, (lv, acc, _cnt) in gl.items():
                agg.setdefault(n, []).append((float(lv.detach()), acc))
            if "ind" in gl:
                recent_ind = (recent_ind + [float(gl["ind"][0].detach())])[-20:]
            done = until_ind is not None and len(recent_ind) == 20 and sum(recent_ind) / 20 < until_ind
            if (k + 1) % 50 == 0 or k == n_steps - 1 or done:
                msg = " ".join(
                    f"{n}={sum(x[0] for x in v) / len(v):.2f}/{sum(x[1] for x in v) / len(v):.2f}"
                    for n, v in agg.items()
                )
                el = time.time() - t0
                print(f"[stage {si} T={T}] step {k + 1}/{n_steps} (global {step}) lr {lr_now:.2e} "
                      f"{el / 60:.1f} min | loss/acc {msg}", flush=True)
                log.append({"stage": si, "T": T, "step": step, "minutes": el / 60,
                            **{n: [sum(x[0] for x in v) / len(v), sum(x[1] for x in v) / len(v)]
                               for n, v in agg.items()}})
                agg = {}
            if done:
                print(f"induction loss below {until_ind}: stage {si} ends at step {k + 1}", flush=True)
                break
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "stage": si, "step": step,
                    "sched": sched},
                   args.work_dir / "last.tmp")
        os.replace(args.work_dir / "last.tmp", ck)
        print(f"stage {si} done in {(time.time() - ts) / 60:.1f} min; checkpoint {ck}", flush=True)

    minutes = (time.time() - t0) / 60
    meta = {
        "seed": args.seed, "stages": stages, "steps": step, "lr": args.lr, "weights": WEIGHTS,
        "threads": args.threads, "minutes_this_run": round(minutes, 1), "params": n_params,
        "torch": torch.__version__, "log": log,
        "command": "python tools/tiny/train.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    save_final(model, tok, args.out, meta)
    print(f"saved {args.out} after {minutes:.1f} min", flush=True)


if __name__ == "__main__":
    main()
