"""Train ``headlab-tiny-vlm``: a tiny LLaVA whose answers about ``shapes`` images depend on the image.

CPU only, seeded, about 26 minutes on one core (1800 steps). Usage (from the repository root)::

    python plugins/models/tiny/train_vlm.py               # writes headlab-tiny-vlm/
    python plugins/models/tiny/train_vlm.py --quick       # a 2-minute smoke run into /tmp

What it does
------------
1. Tokenizer: ``headlab-tiny``'s word-level tokenizer with the words of the ``shapes`` task it lacks
   (:data:`NEW_WORDS`) appended to its vocabulary and ``<image>`` added as a special token.
2. Model: ``LlavaForConditionalGeneration`` with a 2-layer CLIP vision tower (64 x 64 images, 8 x 8 patches,
   so an image is 64 tokens after the CLS token is dropped) and a 2-layer GELU projector, whose language model
   is ``headlab-tiny`` (4 layers, 8 query heads over 4 key/value heads, hidden 128) with its embedding matrix
   extended to the new vocabulary (old rows copied, new rows random). The vision tower and projector start
   random.
3. Data: images drawn with :func:`headlab.plugins.tasks.shapes.draw_scene` (the ``shapes`` task's drawing:
   shapes in distinct cells of a 3 x 3 grid, seeded radii and offsets; 1 to 6 objects over the task's default
   6 colours x 5 shapes on white), each followed by several questions in the task's prompt format
   (``<image>\\nQuestion: {question}\\nAnswer:`` then the answer and ``<eos>``; later questions of a row repeat
   ``Question: ... Answer:`` without a new image): presence in POPE's format (balanced yes/no; half the absent
   objects share the colour or the shape of a present one), colour, count, and a caption ("Describe the
   image." -> "a red circle, a blue square and a green star.", objects in reading order). Only answer
   tokens (and their ``<eos>``) carry loss. Images are drawn at 224 pixels (the task's default) or at a
   random size in 64..224 and resized by the processor.
4. Held-out check every ``--eval-every`` steps: presence accuracy on 256 questions about images built by the
   ``shapes`` task itself (another seed stream), with the real image and with a blank (white) image.
5. Saves the model (safetensors), tokenizer, processor (``AutoProcessor`` loads it; PIL image processor, no
   torchvision) and ``training.json`` to ``--out`` (default ``plugins/models/tiny/headlab-tiny-vlm``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from headlab.plugins.tasks import shapes as SH

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "headlab-tiny"
DEFAULT_OUT = HERE / "headlab-tiny-vlm"

NEW_WORDS = ["Is", "image", "yes", "no", "colour", "How", "are", "Describe", "circle", "triangle", "cross",
             "circles", "squares", "triangles", "stars", "crosses", "zero", "four", "five", "six", "seven",
             "eight", "nine"]
IMAGE_TOKEN = "<image>"
PAD, BOS, EOS = 0, 1, 2
IMAGE_SIZE, PATCH = 64, 8
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]  # the shapes task's default colours
SHAPES = list(SH.SHAPES)
KINDS = ["presence", "colour", "count", "caption"]
VISION = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=128)


# ----------------------------------------------------------------------------------------------------
# Tokenizer, model, processor
# ----------------------------------------------------------------------------------------------------


def build_tokenizer():
    """headlab-tiny's tokenizer with :data:`NEW_WORDS` and the ``<image>`` special token."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(SOURCE / "tokenizer.json"))
    vocab = tok.get_vocab()
    for w in NEW_WORDS:
        if w not in vocab:
            vocab[w] = len(vocab)
    tok.model = models.WordLevel(vocab=vocab, unk_token="<unk>")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left", model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    fast.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return fast


def build_processor(tokenizer):
    """LLaVA's processor: CLIP preprocessing (PIL backend) to 64 x 64, ``<image>`` -> 64 image tokens."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          image_token=IMAGE_TOKEN)


def build_model(tokenizer):
    """The LLaVA model, language model initialised from headlab-tiny."""
    from safetensors.torch import load_file
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = json.loads((SOURCE / "config.json").read_text())
    for k in ("architectures", "transformers_version", "dtype", "model_type"):
        text.pop(k, None)
    tc = LlamaConfig(**text)
    tc.vocab_size = int(math.ceil(len(tokenizer) / 64) * 64)
    cfg = LlavaConfig(vision_config=CLIPVisionConfig(**VISION), text_config=tc,
                      image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=-1,
                      vision_feature_select_strategy="default", image_seq_length=N_IMAGE_TOKENS,
                      tie_word_embeddings=True, projector_hidden_act="gelu")
    cfg._attn_implementation = "sdpa"
    model = LlavaForConditionalGeneration(cfg)
    state = load_file(str(SOURCE / "model.safetensors"))
    lm = model.model.language_model
    emb = state.pop("model.embed_tokens.weight")
    state.pop("lm_head.weight", None)
    own = {k.removeprefix("model."): v for k, v in state.items()}
    missing, unexpected = lm.load_state_dict(own, strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)
    with torch.no_grad():
        lm.embed_tokens.weight[: emb.shape[0]] = emb
    model.tie_weights()
    return model


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def scene(rng: random.Random, lo: int = 1, hi: int = 6, size: int = 224):
    """Objects ``(colour, shape, (cx, cy, r))`` in distinct cells of the 3 x 3 grid, in reading order."""
    k = rng.randint(lo, hi)
    pairs = rng.sample([(c, s) for c in COLOURS for s in SHAPES], k)
    cells = sorted(rng.sample(range(9), k))
    rng.shuffle(pairs)
    cell = size / 3
    out = []
    for (colour, shape), at in zip(pairs, cells, strict=True):
        r = cell * 0.4 * rng.uniform(0.6, 1.0)
        slack = cell / 2 - r
        cx = (at % 3 + 0.5) * cell + rng.uniform(-slack, slack)
        cy = (at // 3 + 0.5) * cell + rng.uniform(-slack, slack)
        out.append((colour, shape, (cx, cy, r)))
    return out


def caption(objs) -> str:
    """``a red circle, a blue square and a green star.`` (objects in the given order)."""
    names = [f"{article(c)} {c} {s}" for c, s, _ in objs]
    text = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return text + "."


def questions(rng: random.Random, objs, caption_p: float = 0.5) -> list[tuple[str, str, str]]:
    """(kind, question, answer) about a scene: 2 presence (one yes, one no), a colour, a count, maybe a caption."""
    from collections import Counter

    present = [SH.object_name(c, s) for c, s, _ in objs]
    counts = Counter(s for _, s, _ in objs)
    out = []
    pos = rng.choice(present)
    absent = [SH.object_name(c, s) for c in COLOURS for s in SHAPES if SH.object_name(c, s) not in present]
    hard = [o for o in absent if any(o.split()[0] == p.split()[0] or o.split()[1] == p.split()[1] for p in present)]
    neg = rng.choice(hard if hard and rng.random() < 0.5 else absent)
    for obj, label in ((pos, "yes"), (neg, "no")):
        out.append(("presence", f"Is there {article(obj)} {obj} in the image?", label))
    once = [s for s, c in counts.items() if c == 1]
    if once:
        s = rng.choice(once)
        out.append(("colour", f"What colour is the {s}?", next(c for c, sh, _ in objs if sh == s)))
    s = rng.choice(sorted(counts))
    out.append(("count", f"How many {SH.plural(s)} are there?", SH.NUMBER_WORDS[counts[s]]))
    if rng.random() < caption_p:
        out.append(("caption", "Describe the image.", caption(objs)))
    rng.shuffle(out)
    return out


class Data:
    """Rows: one image, then several question/answer episodes; loss labels on answers only."""

    def __init__(self, tokenizer, processor, seed: int):
        self.tok = tokenizer
        self.proc = processor
        self.rng = random.Random(seed)
        self.image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    def enc(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def row(self):
        rng = self.rng
        size = 224 if rng.random() < 0.6 else rng.randint(IMAGE_SIZE, 224)
        objs = scene(rng, size=size)
        image = SH.draw_scene(objs, size, "white")
        ids = [BOS] + [self.image_id] * N_IMAGE_TOKENS
        lab = [-100] * len(ids)
        kind_at = []
        for k, (kind, q, a) in enumerate(questions(rng, objs)):
            p = self.enc(("\n" if k == 0 else "") + f"Question: {q}\nAnswer:")
            t = self.enc(" " + a) + [EOS]
            ids += p
            lab += [-100] * len(p)
            kind_at.append((len(ids), KINDS.index(kind)))
            ids += t
            lab += t
        return ids, lab, image, kind_at

    def batch(self, B: int):
        rows = [self.row() for _ in range(B)]
        L = max(len(r[0]) for r in rows)
        ids = torch.full((B, L), PAD, dtype=torch.long)
        lab = torch.full((B, L), -100, dtype=torch.long)
        att = torch.zeros((B, L), dtype=torch.long)
        kind = torch.full((B, L), -1, dtype=torch.long)  # the kind of the answer's first token
        for b, (i, lb, _, ka) in enumerate(rows):
            ids[b, : len(i)] = torch.tensor(i)
            lab[b, : len(lb)] = torch.tensor(lb)
            att[b, : len(i)] = 1
            for at, k in ka:
                kind[b, at] = k
        pv = self.proc.image_processor(images=[r[2] for r in rows], return_tensors="pt")["pixel_values"]
        return ids, lab, att, pv, kind


def heldout(n_images: int = 128, seed: int = 99):
    """Presence questions (POPE format, balanced, random negatives) built by the ``shapes`` task itself."""
    from headlab import TaskContext

    cfg = SH.Shapes(n=n_images, question="presence", per_image=1)
    return SH.build_shapes(cfg, TaskContext(tokenizer=None, seed=seed, vocab_size=0))


@torch.no_grad()
def presence_accuracy(model, processor, examples, blank: bool = False) -> dict[str, float]:
    """Greedy first-token answers (yes/no) with the real image or a blank one; accuracy and yes-ratio."""
    from PIL import Image

    tok = processor.tokenizer
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    right = said_yes = 0
    model.eval()
    for i in range(0, len(examples), 64):
        chunk = examples[i: i + 64]
        images = [Image.new("RGB", (224, 224), SH.COLOURS["white"]) if blank else ex.images[0] for ex in chunk]
        enc = processor(text=[ex.prompt for ex in chunk], images=images, return_tensors="pt", padding=True)
        logits = model(**enc).logits[:, -1]
        pred = logits.argmax(-1)
        for ex, p in zip(chunk, pred.tolist(), strict=True):
            ans = "yes" if p == yes else "no" if p == no else "?"
            right += ans == ex.meta["label"]
            said_yes += ans == "yes"
    model.train()
    return {"accuracy": right / len(examples), "yes_ratio": said_yes / len(examples)}


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------


def save_final(model, processor, out: Path, meta: dict[str, Any]) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                                               do_sample=False, max_new_tokens=24)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/headlab-tiny-vlm-train"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared machine")
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate of the language model")
    ap.add_argument("--vision-lr", type=float, default=3e-3, help="peak learning rate of the tower and projector")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few minutes into /tmp")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --work-dir")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if args.quick:
        args.steps, args.eval_every = 40, 20
        if args.out == DEFAULT_OUT:
            args.out = Path("/tmp/headlab-tiny-vlm-quick")
    args.work_dir.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer()
    processor = build_processor(tok)
    model = build_model(tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tok)}, params {n_params / 1e6:.2f}M, image tokens {N_IMAGE_TOKENS}", flush=True)

    vision = [p for n, p in model.named_parameters() if not n.startswith("model.language_model")
              and not n.startswith("lm_head")]
    text = [p for n, p in model.named_parameters() if n.startswith("model.language_model")]
    opt = torch.optim.AdamW([{"params": vision, "peak": args.vision_lr}, {"params": text, "peak": args.lr}],
                            lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)

    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        p = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

    step, log = 0, []
    ck = args.work_dir / "last.pt"
    if args.resume and ck.exists():
        state = torch.load(ck, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, log = state["step"], state["log"]
        random.setstate(state["random"])
        torch.set_rng_state(state["torch"])
        print(f"resumed at step {step}", flush=True)
    data = Data(tok, processor, args.seed * 1000 + step)
    held = heldout()
    t0 = time.time()
    model.train()
    agg: dict[str, list[float]] = {}
    while step < args.steps:
        for g in opt.param_groups:
            g["lr"] = g["peak"] * factor(step)
        ids, lab, att, pv, kind = data.batch(args.batch)
        logits = model(input_ids=ids, attention_mask=att, pixel_values=pv).logits[:, :-1]
        tgt = lab[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        with torch.no_grad():
            right = logits.argmax(-1) == tgt
            k = kind[:, 1:]  # position t predicts token t + 1 (an answer's first token at t + 1)
            agg.setdefault("loss", []).append(float(loss))
            for j, name in enumerate(KINDS):
                m = k == j
                if m.any():
                    agg.setdefault(name, []).append(float(right[m].float().mean()))
        if step % 25 == 0 or step == args.steps:
            msg = " ".join(f"{n}={sum(v) / len(v):.3f}" for n, v in agg.items())
            el = (time.time() - t0) / 60
            print(f"step {step}/{args.steps} lr {opt.param_groups[1]['lr']:.2e} {el:.1f} min | {msg}", flush=True)
            entry: dict[str, Any] = {"step": step, "minutes": round(el, 2),
                                     **{n: round(sum(v) / len(v), 4) for n, v in agg.items()}}
            agg = {}
            if step % args.eval_every == 0 or step == args.steps:
                real = presence_accuracy(model, processor, held)
                blank = presence_accuracy(model, processor, held, blank=True)
                entry["heldout_presence"] = {"image": real, "blank": blank}
                print(f"  held-out presence: image {real}, blank {blank}", flush=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log + [entry],
                            "random": random.getstate(), "torch": torch.get_rng_state()}, ck)
            log.append(entry)

    minutes = (time.time() - t0) / 60
    meta = {
        "seed": args.seed, "steps": step, "batch": args.batch, "lr": args.lr, "vision_lr": args.vision_lr,
        "warmup": args.warmup, "threads": args.threads, "minutes_this_run": round(minutes, 1), "params": n_params,
        "image_size": IMAGE_SIZE, "patch_size": PATCH, "vision": VISION, "new_words": NEW_WORDS,
        "torch": torch.__version__, "log": log,
        "command": "python plugins/models/tiny/train_vlm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    save_final(model, processor, args.out, meta)
    print(f"saved {args.out} after {minutes:.1f} min", flush=True)


if __name__ == "__main__":
    main()
