"""Train ``headlab-tiny-vlm``: a tiny LLaVA whose answers about ``shapes`` images depend on the image.

CPU only, seeded, about 51 minutes: 1000 tower steps and 1400 steps of the whole model (33 minutes, one
thread), 450 presence-heavy steps from that checkpoint (13 minutes), then 300 steps of captions with
co-occurrence noise (5 minutes, two threads). The shipped checkpoint is (from the repository root)::

    python tools/tiny/train_vlm.py --out /tmp/headlab-tiny-vlm-stage1
    python tools/tiny/train_vlm.py --init /tmp/headlab-tiny-vlm-stage1 --vision-steps 0 --steps 450 \\
        --presence 4 --hard 0.8 --lr 1e-3 --vision-lr 5e-4 --aux-weight 0 --warmup 20 --eval-every 150 \\
        --out /tmp/headlab-tiny-vlm-stage2
    python tools/tiny/train_vlm.py --init /tmp/headlab-tiny-vlm-stage2 --vision-steps 0 --steps 300 \\
        --cooccur 0.5 --noisy 0.5 --caption 1.0 --aux-weight 0 --lr 1e-3 --vision-lr 5e-4 --warmup 20 \\
        --eval-every 150 --threads 2
    python tools/tiny/train_vlm.py --quick       # a 1-minute smoke run into /tmp

What it does
------------
1. Tokenizer: ``headlab-tiny``'s word-level tokenizer with the words of the ``shapes`` task it lacks
   (:data:`NEW_WORDS`) appended to its vocabulary and ``<image>`` added as a special token.
2. Model: ``LlavaForConditionalGeneration`` with a 3-layer CLIP vision tower (96 x 96 images, 12 x 12
   patches, so an image is 64 tokens after the CLS token is dropped; a shape of the task's 224-pixel images
   is 15-26 pixels, about two patches, across) and a 2-layer GELU projector, whose language model is
   ``headlab-tiny`` (4 layers, 8 query heads over 4 key/value heads, hidden 128) with its embedding matrix
   extended to the new vocabulary (old rows copied, new rows random). The vision tower and projector start
   random.
3. Data: images drawn at 224 pixels (the task's default) with :func:`headlab.plugins.tasks.shapes.draw_scene`
   (shapes in distinct cells of a 3 x 3 grid with the task's radii and offsets; 1 to 5 objects over the task's
   default 6 colours x 5 shapes on white) and resized by the processor. Per image, the auxiliary target: each
   patch's shape and colour (of the object covering most of it; background when none covers a fifth). Per
   image, questions in the task's prompt format (``<image>\\nQuestion: {question}\\nAnswer:`` then the answer
   and ``<eos>``; later questions of a row repeat ``Question: ... Answer:`` without a new image): presence in
   POPE's format (up to 2 yes and as many no; 60% of the absent objects have the colour of a present object
   and another shape, so colour alone cannot answer, 20% the shape of a present one in another colour),
   colour, count, and with probability 0.7 a caption ("Describe the image." -> "a red circle, a blue square
   and a green star.", objects in reading order). Only answer tokens (and their ``<eos>``) carry the language
   loss.
4. Stage 1 (``--vision-steps``): the tower alone, with a linear per-patch readout of shape and colour
   (:class:`PatchHead`, training only, not saved), cross-entropy on the patch labels. Stage 2 (``--steps``):
   the whole model, answer loss + ``--aux-weight`` x the readout loss. ``--init`` continues from a saved
   checkpoint (the readout starts afresh, so the second command sets ``--aux-weight 0``): the shipped model's
   second stage asks 4 yes and 4 no presence questions per image, 80% of the absent objects of a present
   colour. The third (``--cooccur``, ``--noisy``): objects come in fixed couples (:data:`PARTNER`), drawn
   together with probability ``--cooccur``, and a caption names an object's undrawn partner right after it
   with probability ``--noisy`` (the other answers stay true), the language prior real caption data gives
   VLMs. ``--image-sparsity`` adds a penalty that concentrates image reading on few heads (tried, not kept).
5. Held-out checks every ``--eval-every`` steps: per-object shape / colour accuracy of the readout (256 images
   of 2-4 objects, another seed stream), and POPE adversarial presence accuracy on 256 questions built by
   the ``shapes`` task itself, with the real image and with a blank (white) image.
6. Saves the model (safetensors), tokenizer, processor (``AutoProcessor`` loads it; PIL image processor, no
   torchvision) and ``training.json`` to ``--out`` (default ``headlab/plugins/models/tiny/headlab-tiny-vlm``).
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
CHECKPOINTS = HERE.parents[1] / "headlab" / "plugins" / "models" / "tiny"  # where the embedded checkpoints ship
SOURCE = CHECKPOINTS / "headlab-tiny"
DEFAULT_OUT = CHECKPOINTS / "headlab-tiny-vlm"

NEW_WORDS = ["Is", "image", "yes", "no", "colour", "How", "are", "Describe", "circle", "triangle", "cross",
             "circles", "squares", "triangles", "stars", "crosses", "zero", "four", "five", "six", "seven",
             "eight", "nine"]
IMAGE_TOKEN = "<image>"
PAD, BOS, EOS = 0, 1, 2
IMAGE_SIZE, PATCH = 96, 12
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]  # the shapes task's default colours
SHAPES = list(SH.SHAPES)
OBJECTS = [(c, s) for c in COLOURS for s in SHAPES]  # every (colour, shape) the scenes draw from
KINDS = ["presence", "colour", "count", "caption"]
VISION = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=128)


def set_geometry(image_size: int, patch: int, layers: int) -> None:
    """Model resolution, patch size and tower depth (module-level constants used by the builders)."""
    global IMAGE_SIZE, PATCH, N_IMAGE_TOKENS
    IMAGE_SIZE, PATCH = image_size, patch
    N_IMAGE_TOKENS = (image_size // patch) ** 2
    VISION.update(image_size=image_size, patch_size=patch, num_hidden_layers=layers)


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
    """LLaVA's processor: CLIP preprocessing (PIL backend) to ``IMAGE_SIZE``, ``<image>`` -> one token per patch."""
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


def partners() -> dict[tuple[str, str], tuple[str, str]]:
    """A fixed pairing of the 30 objects into 15 couples (seeded), for co-occurrence-biased training scenes."""
    objs = list(OBJECTS)
    random.Random(1234).shuffle(objs)
    out = {}
    for a, b in zip(objs[0::2], objs[1::2], strict=True):
        out[a], out[b] = b, a
    return out


PARTNER = partners()


def scene(rng: random.Random, lo: int = 1, hi: int = 5, size: int = 224, cooccur: float = 0.0):
    """Objects ``(colour, shape, (cx, cy, r))`` in distinct cells of the 3 x 3 grid, in reading order (the
    shapes task's placement: radius 0.24-0.4 of a cell, a random offset inside the cell). With ``cooccur`` > 0,
    each object drawn brings its :data:`PARTNER` with that probability (room permitting), the way real
    captioning data pairs objects (a fork with a knife)."""
    k = rng.randint(lo, hi)
    if cooccur > 0:
        pairs: list[tuple[str, str]] = []
        while len(pairs) < k:
            o = rng.choice([x for x in OBJECTS if x not in pairs])
            pairs.append(o)
            if len(pairs) < k and PARTNER[o] not in pairs and rng.random() < cooccur:
                pairs.append(PARTNER[o])
    else:
        pairs = rng.sample(OBJECTS, k)
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


def negative(rng: random.Random, present: list[str], hard: float = 0.6) -> str:
    """An absent object: with probability ``hard`` the colour of a present object with another shape (colour
    alone cannot answer), else half the time the shape of a present object in another colour, else any."""
    absent = [SH.object_name(c, s) for c in COLOURS for s in SHAPES if SH.object_name(c, s) not in present]
    colours = {p.split()[0] for p in present}
    shapes = {p.split()[1] for p in present}
    u = rng.random()
    pool = ([o for o in absent if o.split()[0] in colours] if u < hard else
            [o for o in absent if o.split()[1] in shapes] if u < hard + (1 - hard) / 2 else absent)
    return rng.choice(pool or absent)


def questions(rng: random.Random, objs, caption_p: float = 0.7, n_presence: int = 2,
              hard: float = 0.6, noisy: float = 0.0) -> list[tuple[str, str, str]]:
    """(kind, question, answer) about a scene: presence (as many yes as no, hard negatives), a colour, a
    count, maybe a caption."""
    from collections import Counter

    present = [SH.object_name(c, s) for c, s, _ in objs]
    counts = Counter(s for _, s, _ in objs)
    out = []
    n_yes = min(n_presence, len(present))
    negs: list[str] = []
    for _ in range(n_yes):
        negs.append(negative(rng, present + negs, hard))
    for obj, label in [(o, "yes") for o in rng.sample(present, n_yes)] + [(o, "no") for o in negs]:
        out.append(("presence", f"Is there {article(obj)} {obj} in the image?", label))
    once = [s for s, c in counts.items() if c == 1]
    if once:
        s = rng.choice(once)
        out.append(("colour", f"What colour is the {s}?", next(c for c, sh, _ in objs if sh == s)))
    s = rng.choice(sorted(counts))
    out.append(("count", f"How many {SH.plural(s)} are there?", SH.NUMBER_WORDS[counts[s]]))
    if rng.random() < caption_p:
        named = list(objs)
        if noisy > 0:  # caption noise tied to co-occurrence: an undrawn partner named after its object
            drawn = {(c, sh) for c, sh, _ in objs}
            named = []
            for o in objs:
                named.append(o)
                partner = PARTNER[(o[0], o[1])]
                if partner not in drawn and rng.random() < noisy:
                    named.append((*partner, None))
        out.append(("caption", "Describe the image.", caption(named)))
    rng.shuffle(out)
    return out


def patch_labels(objs, size: int = 224) -> tuple[list[int], list[int]]:
    """Per image patch (row-major over the model's patch grid): the shape (1 + index in :data:`SHAPES`) and
    colour (1 + index in :data:`COLOURS`) of the object covering most of the patch, 0 (background) when no
    object covers a fifth of it; the target of the tower's auxiliary loss."""
    import numpy as np

    grid = IMAGE_SIZE // PATCH
    k = IMAGE_SIZE / size
    cover = np.zeros((len(objs) + 1, grid, grid))
    cover[0] = 0.2
    for j, (_, shape, (cx, cy, r)) in enumerate(objs):
        mask = SH.draw_scene([("white", shape, (cx * k, cy * k, r * k))], IMAGE_SIZE, "black").convert("L")
        m = np.asarray(mask, dtype=np.float32) / 255.0
        cover[j + 1] = m.reshape(grid, PATCH, grid, PATCH).mean((1, 3))
    best = cover.argmax(0).ravel()
    shape_lab = [0 if b == 0 else 1 + SHAPES.index(objs[b - 1][1]) for b in best]
    colour_lab = [0 if b == 0 else 1 + COLOURS.index(objs[b - 1][0]) for b in best]
    return shape_lab, colour_lab


class Data:
    """Rows: one image, then several question/answer episodes; loss labels on answers only; per-patch labels."""

    def __init__(self, tokenizer, processor, seed: int, lo: int = 1, hi: int = 5, n_presence: int = 2,
                 hard: float = 0.6, cooccur: float = 0.0, caption_p: float = 0.7, noisy: float = 0.0):
        self.tok = tokenizer
        self.proc = processor
        self.rng = random.Random(seed)
        self.lo, self.hi = lo, hi
        self.n_presence, self.hard = n_presence, hard
        self.cooccur, self.caption_p, self.noisy = cooccur, caption_p, noisy
        self.image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    def enc(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def images(self, B: int):
        """``B`` scenes: pixel values and per-patch shape / colour labels."""
        objs = [scene(self.rng, self.lo, self.hi, cooccur=self.cooccur) for _ in range(B)]
        pv = self.proc.image_processor(images=[SH.draw_scene(o, 224, "white") for o in objs],
                                       return_tensors="pt")["pixel_values"]
        labs = [patch_labels(o) for o in objs]
        return objs, pv, torch.tensor([x[0] for x in labs]), torch.tensor([x[1] for x in labs])

    def row(self, objs):
        rng = self.rng
        ids = [BOS] + [self.image_id] * N_IMAGE_TOKENS
        lab = [-100] * len(ids)
        kind_at = []
        for k, (kind, q, a) in enumerate(questions(rng, objs, caption_p=self.caption_p, n_presence=self.n_presence,
                                                       hard=self.hard, noisy=self.noisy)):
            p = self.enc(("\n" if k == 0 else "") + f"Question: {q}\nAnswer:")
            t = self.enc(" " + a) + [EOS]
            ids += p
            lab += [-100] * len(p)
            kind_at.append((len(ids), KINDS.index(kind)))
            ids += t
            lab += t
        return ids, lab, kind_at

    def batch(self, B: int):
        objs, pv, shape_lab, colour_lab = self.images(B)
        rows = [self.row(o) for o in objs]
        L = max(len(r[0]) for r in rows)
        ids = torch.full((B, L), PAD, dtype=torch.long)
        lab = torch.full((B, L), -100, dtype=torch.long)
        att = torch.zeros((B, L), dtype=torch.long)
        kind = torch.full((B, L), -1, dtype=torch.long)  # the kind of the answer's first token
        for b, (i, lb, ka) in enumerate(rows):
            ids[b, : len(i)] = torch.tensor(i)
            lab[b, : len(lb)] = torch.tensor(lb)
            att[b, : len(i)] = 1
            for at, k in ka:
                kind[b, at] = k
        return ids, lab, att, pv, kind, shape_lab, colour_lab


class PatchHead(torch.nn.Module):
    """The auxiliary readout (training only, not saved): shape and colour of each patch from the tower's last
    hidden state (what the projector reads)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.shape = torch.nn.Linear(hidden, 1 + len(SHAPES))
        self.colour = torch.nn.Linear(hidden, 1 + len(COLOURS))

    def forward(self, h):
        return self.shape(h), self.colour(h)


def image_attention(attentions, ids, lab, image_id: int) -> torch.Tensor:
    """(layer, head): the attention mass on image tokens from the positions that predict answer tokens,
    averaged over those positions (the quantity the sparsity penalty concentrates on a few heads)."""
    queries = torch.zeros_like(lab, dtype=torch.bool)
    queries[:, :-1] = lab[:, 1:] != -100
    keys = (ids == image_id).to(attentions[0].dtype)
    rows = []
    for a in attentions:  # (batch, head, query, key)
        on_image = torch.einsum("bhqk,bk->bhq", a, keys)
        rows.append((on_image * queries[:, None]).sum((0, 2)) / queries.sum())
    return torch.stack(rows)


def tower_features(model, pv):
    """The tower's last hidden state without the CLS token (LLaVA's default feature selection)."""
    out = model.model.vision_tower(pv, output_hidden_states=True)
    return out.hidden_states[-1][:, 1:]


def aux_loss(head, feats, shape_lab, colour_lab):
    s, c = head(feats)
    f = torch.nn.functional.cross_entropy
    loss = f(s.reshape(-1, s.shape[-1]), shape_lab.reshape(-1)) + f(c.reshape(-1, c.shape[-1]), colour_lab.reshape(-1))
    return loss, s, c


@torch.no_grad()
def object_accuracy(model, head, data_seed: int = 77, n: int = 256, lo: int = 2, hi: int = 4) -> dict[str, float]:
    """Held-out per-object recognition by the auxiliary readout: an object's shape (colour) is the argmax of
    the summed logits over the patches it covers most; images drawn like the shapes task's (2-4 objects)."""
    rng = random.Random(data_seed)
    objs = [scene(rng, lo, hi) for _ in range(n)]
    proc = build_processor(build_tokenizer()).image_processor
    pv = proc(images=[SH.draw_scene(o, 224, "white") for o in objs], return_tensors="pt")["pixel_values"]
    s, c = head(tower_features(model, pv))
    right_s = right_c = total = 0
    for b, o in enumerate(objs):
        sl, cl = patch_labels(o)
        sl_t = torch.tensor(sl)
        for colour, shape, _ in o:
            m = (sl_t == 1 + SHAPES.index(shape)) & (torch.tensor(cl) == 1 + COLOURS.index(colour))
            if not m.any():
                continue
            total += 1
            right_s += int(s[b][m][:, 1:].sum(0).argmax()) == SHAPES.index(shape)
            right_c += int(c[b][m][:, 1:].sum(0).argmax()) == COLOURS.index(colour)
    return {"shape": round(right_s / max(total, 1), 4), "colour": round(right_c / max(total, 1), 4),
            "objects": total}


def heldout(n_images: int = 128, seed: int = 99, negatives: str = "adversarial"):
    """Presence questions (POPE format, balanced) built by the ``shapes`` task itself."""
    from headlab import TaskContext

    cfg = SH.Shapes(n=n_images, question="presence", per_image=1, negatives=negatives)
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared machine")
    ap.add_argument("--image-size", type=int, default=IMAGE_SIZE)
    ap.add_argument("--patch", type=int, default=PATCH)
    ap.add_argument("--layers", type=int, default=VISION["num_hidden_layers"], help="vision tower layers")
    ap.add_argument("--vision-steps", type=int, default=1000, help="stage 1: tower + patch readout only")
    ap.add_argument("--vision-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1400, help="stage 2: the whole model")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate of the language model")
    ap.add_argument("--vision-lr", type=float, default=2e-3, help="peak learning rate of the tower and projector")
    ap.add_argument("--aux-weight", type=float, default=0.5, help="weight of the patch readout loss in stage 2")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--presence", type=int, default=2, help="yes questions per image (and as many no)")
    ap.add_argument("--hard", type=float, default=0.6, help="share of absent objects with a present colour")
    ap.add_argument("--cooccur", type=float, default=0.0,
                    help="probability that an object drawn brings its fixed partner (co-occurrence bias)")
    ap.add_argument("--noisy", type=float, default=0.0,
                    help="probability that a caption names an object's undrawn partner right after it")
    ap.add_argument("--image-sparsity", type=float, default=0.0,
                    help="weight of sum over heads of sqrt(attention mass on the image): few heads read the image")
    ap.add_argument("--caption", type=float, default=0.7, help="probability of a caption question per image")
    ap.add_argument("--init", type=Path, default=None, help="start from this saved checkpoint (a later stage)")
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few minutes into /tmp")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    set_geometry(args.image_size, args.patch, args.layers)
    if args.quick:
        args.vision_steps, args.steps, args.eval_every = 20, 40, 20
        if args.out == DEFAULT_OUT:
            args.out = Path("/tmp/headlab-tiny-vlm-quick")

    tok = build_tokenizer()
    processor = build_processor(tok)
    if args.init is None:
        model = build_model(tok)
    else:
        from transformers import LlavaForConditionalGeneration

        model = LlavaForConditionalGeneration.from_pretrained(
            args.init, attn_implementation="eager" if args.image_sparsity > 0 else "sdpa")
        log_init = json.loads((args.init / "training.json").read_text())
    head = PatchHead(VISION["hidden_size"])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tok)}, params {n_params / 1e6:.2f}M, image {IMAGE_SIZE}/{PATCH}: {N_IMAGE_TOKENS} tokens, "
          f"tower layers {VISION['num_hidden_layers']}", flush=True)
    t0 = time.time()
    log: list[dict[str, Any]] = []

    def schedule(step: int, total: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        p = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

    # ---- stage 1: the tower learns to name each patch's shape and colour (language model untouched)
    data = Data(tok, processor, args.seed * 1000 + 1)
    tower = model.model.vision_tower
    params = list(tower.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=args.vision_lr, betas=(0.9, 0.95), weight_decay=0.05)
    for step in range(args.vision_steps):
        for g in opt.param_groups:
            g["lr"] = args.vision_lr * schedule(step, args.vision_steps)
        _, pv, sl, cl = data.images(args.vision_batch)
        loss, s, _ = aux_loss(head, tower_features(model, pv), sl, cl)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.vision_steps:
            tower.eval()
            acc = object_accuracy(model, head)
            tower.train()
            el = (time.time() - t0) / 60
            print(f"vision step {step + 1}/{args.vision_steps} {el:.1f} min loss {loss.item():.3f} | held-out "
                  f"objects {acc}", flush=True)
            log.append({"stage": "vision", "step": step + 1, "minutes": round(el, 2), "aux_loss": round(loss.item(), 4),
                        "heldout_objects": acc})

    # ---- stage 2: everything, answer tokens' loss + the patch readout's
    grabbed: dict[str, torch.Tensor] = {}

    def grab(_module, _inputs, output):
        grabbed["h"] = output[0] if isinstance(output, tuple) else output

    hook = tower.encoder.layers[-1].register_forward_hook(grab)
    vision = [p for n, p in model.named_parameters() if not n.startswith("model.language_model")
              and not n.startswith("lm_head")] + list(head.parameters())
    text = [p for n, p in model.named_parameters() if n.startswith("model.language_model")]
    opt = torch.optim.AdamW([{"params": vision, "peak": args.vision_lr}, {"params": text, "peak": args.lr}],
                            lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    data = Data(tok, processor, args.seed * 1000 + 2 + (10 if args.init else 0), n_presence=args.presence,
                hard=args.hard, cooccur=args.cooccur, caption_p=args.caption,
                noisy=args.noisy)
    held = heldout()
    model.train()
    agg: dict[str, list[float]] = {}
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = g["peak"] * schedule(step - 1, args.steps)
        ids, lab, att, pv, kind, sl, cl = data.batch(args.batch)
        out = model(input_ids=ids, attention_mask=att, pixel_values=pv, output_attentions=args.image_sparsity > 0)
        logits = out.logits[:, :-1]
        tgt = lab[:, 1:]
        lm_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                                    ignore_index=-100)
        a_loss, _, _ = aux_loss(head, grabbed["h"][:, 1:], sl, cl)
        loss = lm_loss + args.aux_weight * a_loss
        if args.image_sparsity > 0:
            mass = image_attention(out.attentions, ids, lab, data.image_id)
            loss = loss + args.image_sparsity * mass.clamp_min(1e-6).sqrt().sum()
            agg.setdefault("image_heads", []).append(float((mass > 0.1).sum()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            right = logits.argmax(-1) == tgt
            k = kind[:, 1:]  # position t predicts token t + 1 (an answer's first token at t + 1)
            agg.setdefault("loss", []).append(float(lm_loss))
            agg.setdefault("aux_loss", []).append(float(a_loss))
            for j, name in enumerate(KINDS):
                m = k == j
                if m.any():
                    agg.setdefault(name, []).append(float(right[m].float().mean()))
        if step % 25 == 0 or step == args.steps:
            msg = " ".join(f"{n}={sum(v) / len(v):.3f}" for n, v in agg.items())
            el = (time.time() - t0) / 60
            print(f"step {step}/{args.steps} lr {opt.param_groups[1]['lr']:.2e} {el:.1f} min | {msg}", flush=True)
            entry: dict[str, Any] = {"stage": "all", "step": step, "minutes": round(el, 2),
                                     **{n: round(sum(v) / len(v), 4) for n, v in agg.items()}}
            agg = {}
            if step % args.eval_every == 0 or step == args.steps:
                real = presence_accuracy(model, processor, held)
                blank = presence_accuracy(model, processor, held, blank=True)
                model.eval()
                objects = object_accuracy(model, head)
                model.train()
                entry["heldout_presence_adversarial"] = {"image": real, "blank": blank}
                entry["heldout_objects"] = objects
                print(f"  held-out POPE adversarial: image {real}, blank {blank}; objects {objects}", flush=True)
            log.append(entry)
    hook.remove()

    minutes = (time.time() - t0) / 60
    meta = {
        "seed": args.seed, "vision_steps": args.vision_steps, "vision_batch": args.vision_batch, "steps": args.steps,
        "batch": args.batch, "lr": args.lr, "vision_lr": args.vision_lr, "aux_weight": args.aux_weight,
        "warmup": args.warmup, "threads": args.threads, "minutes": round(minutes, 1), "params": n_params,
        "image_size": IMAGE_SIZE, "patch_size": PATCH, "vision": VISION, "new_words": NEW_WORDS,
        "presence": args.presence, "hard": args.hard, "cooccur": args.cooccur, "caption": args.caption,
        "noisy": args.noisy, "image_sparsity": args.image_sparsity,
        "torch": torch.__version__, "log": log,
        "command": "python tools/tiny/train_vlm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if args.init is not None:
        meta = {**meta, "init": str(args.init), "previous": log_init}
    save_final(model, processor, args.out, meta)
    print(f"saved {args.out} after {minutes:.1f} min", flush=True)


if __name__ == "__main__":
    main()
