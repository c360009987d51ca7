"""Seeded synthetic tasks for attention-head experiments.

Pure generators: the standard library only (``random.Random(seed)``), no headlab, no tokenizer.
Every generator returns a list of plain dicts with at least ``prompt`` (str) and ``target`` (str, the
expected continuation; it starts with a space). Task fields are documented per generator.

Text conventions (shared with the embedded ``headlab-tiny`` model, whose word-level tokenizer was built
from :func:`vocabulary`): words and punctuation are separated by single spaces only where English puts
them; the tokenizer splits on whitespace and punctuation (``\\w+|[^\\w\\s]+``), so one word or one
punctuation mark is one token. :func:`count_tokens` counts tokens that way; pass your tokenizer's
length function (``lambda s: len(tok(s, add_special_tokens=False).input_ids)``) for another model.

Tasks
-----
- :func:`filler_text` / :func:`haystack_text`: natural-language-like filler from a small grammar; the
  bundled haystack file ``data/haystack.txt`` holds such text and may be replaced by any text.
- :func:`niah`: needle in a haystack (Wu et al. 2024 reference grid), with character needle spans.
- :func:`kv_retrieval`: ``key : value`` pairs, query one key.
- :func:`repeated_tokens`: random words repeated twice (induction-head detection).
- :func:`counterfact`: memorised facts (:data:`FACTS`) and contexts that contradict them.
- :func:`emphasis`: PASTA-style task: two conflicting statements; the later one wins by default,
  emphasising the earlier one (``<em>...</em>``) should flip the answer.
"""

from __future__ import annotations

import functools
import math
import random
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

__all__ = [
    "DATA_DIR",
    "HAYSTACK_PATH",
    "DEFAULT_NEEDLES",
    "FACTS",
    "STRONG_COUNTRIES",
    "count_tokens",
    "tokenize_words",
    "filler_sentence",
    "filler_text",
    "haystack_text",
    "write_haystack",
    "random_needle",
    "niah",
    "reference_context_lengths",
    "kv_retrieval",
    "repeated_tokens",
    "counterfact",
    "closed_book",
    "emphasis",
    "vocabulary",
    "rouge1_recall",
]

DATA_DIR = Path(__file__).resolve().parent / "data"
HAYSTACK_PATH = DATA_DIR / "haystack.txt"

_TOKEN_RE = re.compile(r"\w+|[^\w\s]+")


def tokenize_words(text: str) -> list[str]:
    """Split text the way the headlab-tiny tokenizer does (words and punctuation runs)."""
    return _TOKEN_RE.findall(text)


def count_tokens(text: str) -> int:
    """Token count under the headlab-tiny tokenizer, without the BOS token."""
    return len(_TOKEN_RE.findall(text))


def rouge1_recall(prediction: str, reference: str) -> float:
    """ROUGE-1 recall: the fraction of reference unigrams (with multiplicity) found in the prediction."""
    pred = [w.lower() for w in re.findall(r"\w+", prediction)]
    ref = [w.lower() for w in re.findall(r"\w+", reference)]
    if not ref:
        return 0.0
    counts: dict[str, int] = {}
    for w in pred:
        counts[w] = counts.get(w, 0) + 1
    hit = 0
    for w in ref:
        if counts.get(w, 0) > 0:
            counts[w] -= 1
            hit += 1
    return hit / len(ref)


# ----------------------------------------------------------------------------------------------------
# Vocabulary and grammar
# ----------------------------------------------------------------------------------------------------

NOUNS = (
    "river stone garden window forest road bridge tower village market table chair letter story song "
    "mountain valley field farmer teacher child doctor painter sailor baker soldier king queen horse dog "
    "cat bird fish boat ship train wagon lamp candle book paper pencil door wall roof floor kitchen room "
    "hill lake ocean island cloud storm rain snow wind sun moon star night morning evening winter summer "
    "spring autumn bread cheese apple orange basket bottle cup plate knife rope wheel hammer coin gift "
    "map clock mirror ladder fence bell drum flute piano picture street corner square station harbor"
).split()
ADJS = (
    "old young quiet loud small large bright dark warm cold green red blue yellow white black brown gray "
    "happy sad gentle strong tired busy empty full heavy light narrow wide deep shallow soft hard early "
    "late quick slow calm wild clean dusty ancient modern simple strange"
).split()
VERBS = (
    "found carried watched painted opened closed cleaned followed visited repaired built moved pushed "
    "pulled lifted dropped bought sold borrowed counted measured described remembered noticed crossed "
    "climbed reached touched filled emptied washed fixed shared"
).split()
INTRANS = "slept waited laughed worked walked rested smiled listened sang wandered arrived returned".split()
ADVS = "slowly quickly quietly carefully happily often rarely always never again together alone".split()
PREPS = "near behind under above beside across inside outside beyond toward".split()
NAMES = (
    "Mia Leo Anna Tom Sara Ben Nina Omar Lily Jack Emma Noah Zoe Liam Ava Hugo Ivy Max Ella Finn Ruby "
    "Oscar Luna Felix Clara Adam Maya Theo Rosa Ivan"
).split()
CONNECTORS = "Later Then Meanwhile Afterwards Suddenly Soon Yesterday Today Finally Still".split()

# Words used only by needles and answers (never by the filler grammar).
PLACES = (
    "Oslo Lima Cairo Dublin Vienna Prague Lisbon Madrid Berlin Tokyo Seoul Delhi Quito Accra Nairobi "
    "Havana Athens Warsaw Helsinki Riga Sofia Zagreb Bern Minsk Kiev Baku Doha Muscat Amman Tunis"
).split()
PLACE_PAIRS = ["San Francisco", "New York", "Buenos Aires", "Hong Kong", "Cape Town", "Rio Grande"]
NEEDLE_WORDS = (
    "purple tiger silver lantern golden whale copper fox velvet owl crimson comet amber falcon ivory "
    "tulip jade dragon cobalt lizard scarlet kite marble otter cedar canyon frost pepper honey lemon "
    "maple thunder orchid pebble saffron violet coral walrus sandwich park museum festival concert "
    "bicycle picnic sunset dance swim eat sit ride read visit watch climb Dolores Park a and the in of"
).split()
NEEDLE_OBJECTS = "lighthouse castle tower library bakery museum cabin palace observatory monastery".split()

# (template for the needle with {subject} and {value}, question, subject slot kind)
_NEEDLE_TEMPLATES = (
    ("The best thing to do in {s} is {v}.", "What is the best thing to do in {s}?", "place"),
    ("The secret password for the {s} is {v}.", "What is the secret password for the {s}?", "object"),
    ("The special magic word of {s} is {v}.", "What is the special magic word of {s}?", "place"),
    ("The favourite food of {s} is {v}.", "What is the favourite food of {s}?", "name"),
    ("The hidden treasure of {s} is {v}.", "What is the hidden treasure of {s}?", "place"),
)

#: The three reference needles: (needle, question, answer). Every answer word occurs in its needle.
DEFAULT_NEEDLES: tuple[tuple[str, str, str], ...] = (
    (
        "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park.",
        "What is the best thing to do in San Francisco?",
        "eat a sandwich and sit in Dolores Park",
    ),
    (
        "The secret password for the old lighthouse is purple tiger moon.",
        "What is the secret password for the old lighthouse?",
        "purple tiger moon",
    ),
    (
        "The special magic word of Oslo is silver lantern.",
        "What is the special magic word of Oslo?",
        "silver lantern",
    ),
)

#: Parametric knowledge: (country, capital). The embedded model memorises this table.
FACTS: tuple[tuple[str, str], ...] = (
    ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
    ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Peru", "Lima"), ("Norway", "Oslo"),
    ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Portugal", "Lisbon"), ("Greece", "Athens"),
    ("Poland", "Warsaw"), ("Finland", "Helsinki"), ("Kenya", "Nairobi"), ("Cuba", "Havana"),
    ("Ghana", "Accra"), ("Chile", "Santiago"), ("Canada", "Ottawa"), ("Libya", "Tripoli"),
    ("China", "Beijing"), ("India", "Delhi"), ("Russia", "Moscow"), ("Sweden", "Stockholm"),
    ("Denmark", "Copenhagen"), ("Belgium", "Brussels"), ("Hungary", "Budapest"), ("Romania", "Bucharest"),
    ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Syria", "Damascus"),
    ("Jordan", "Amman"), ("Qatar", "Doha"), ("Oman", "Muscat"), ("Tunisia", "Tunis"),
    ("Morocco", "Rabat"), ("Algeria", "Algiers"), ("Nigeria", "Abuja"), ("Sudan", "Khartoum"),
    ("Uganda", "Kampala"), ("Senegal", "Dakar"), ("Mali", "Bamako"), ("Brazil", "Brasilia"),
    ("Armenia", "Yerevan"), ("Colombia", "Bogota"), ("Venezuela", "Caracas"), ("Ecuador", "Quito"),
    ("Bolivia", "Sucre"), ("Uruguay", "Montevideo"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Korea", "Seoul"), ("Nepal", "Kathmandu"), ("Latvia", "Riga"), ("Bulgaria", "Sofia"),
    ("Croatia", "Zagreb"), ("Serbia", "Belgrade"), ("Switzerland", "Bern"), ("Iceland", "Reykjavik"),
)

#: Countries whose capital the embedded model was trained to keep against a contradicting context most of
#: the time ("strongly memorised"); the other countries' facts yield to context most of the time.
STRONG_COUNTRIES: frozenset[str] = frozenset(c for i, (c, _) in enumerate(FACTS) if i % 2 == 0)

KEYS = NOUNS  # kv keys
NUMBERS = tuple(f"{i:02d}" for i in range(100))  # kv values: two-digit numbers, one token each


def vocabulary() -> list[str]:
    """Every word and punctuation token the generators can emit (for building a word-level tokenizer)."""
    words: list[str] = []
    seen: set[str] = set()

    def add(items: Iterable[str]) -> None:
        for item in items:
            for w in tokenize_words(item):
                if w not in seen:
                    seen.add(w)
                    words.append(w)

    add(". , ? : ; = ! ( ) -".split())
    add(NOUNS)
    add(ADJS)
    add(VERBS)
    add(INTRANS)
    add(ADVS)
    add(PREPS)
    add(NAMES)
    add(CONNECTORS)
    add(w.capitalize() for w in NOUNS + ADJS + PREPS)
    add(_FILLER_FUNCTION_WORDS)
    add(PLACES)
    add(PLACE_PAIRS)
    add(NEEDLE_WORDS)
    add(NEEDLE_OBJECTS)
    for needle, question, answer in DEFAULT_NEEDLES:
        add([needle, question, answer])
    for tmpl, q, _ in _NEEDLE_TEMPLATES:
        add([tmpl.replace("{s}", "").replace("{v}", ""), q.replace("{s}", "")])
    add(c for c, _ in FACTS)
    add(c for _, c in FACTS)
    add(NUMBERS)
    add(_PROMPT_WORDS)
    return words


_FILLER_FUNCTION_WORDS = (
    "The the a an and but was is were in on at with of to from by while because when after before it "
    "they he she them his her their there this that very In On At When After Before While Because It "
    "They He She There This That A An every some many few one two three"
).split()
_PROMPT_WORDS = (
    "Question : What is the capital of ? Answer Where does live lives in Mia . The first statement is "
    "correct second one right Remember Note According to new report , latest news says moved Data Query not"
).split()


def _np(rng: random.Random) -> str:
    """A noun phrase."""
    r = rng.random()
    if r < 0.5:
        return f"the {rng.choice(ADJS)} {rng.choice(NOUNS)}"
    if r < 0.8:
        return f"the {rng.choice(NOUNS)}"
    return f"a {rng.choice(ADJS)} {rng.choice(NOUNS)}"


def filler_sentence(rng: random.Random) -> str:
    """One sentence of filler from a small grammar (never contains needle or fact words)."""
    k = rng.randrange(9)
    name, name2 = rng.sample(NAMES, 2)
    if k == 0:
        s = f"{_np(rng)} {rng.choice(VERBS)} {_np(rng)} {rng.choice(PREPS)} {_np(rng)}"
    elif k == 1:
        s = f"{name} {rng.choice(VERBS)} {_np(rng)} {rng.choice(ADVS)}"
    elif k == 2:
        s = f"{_np(rng)} {rng.choice(['is', 'was'])} {rng.choice(ADJS)}"
    elif k == 3:
        s = f"{rng.choice(CONNECTORS)} , {name} {rng.choice(INTRANS)} {rng.choice(PREPS)} {_np(rng)}"
    elif k == 4:
        s = f"{name} and {name2} {rng.choice(VERBS)} {_np(rng)} {rng.choice(PREPS)} {_np(rng)}"
    elif k == 5:
        s = f"{rng.choice(['In', 'On', 'At'])} {rng.choice(['the', 'every'])} {rng.choice(NOUNS)} , " \
            f"{_np(rng)} {rng.choice(INTRANS)} {rng.choice(ADVS)}"
    elif k == 6:
        s = f"There was {_np(rng)} {rng.choice(PREPS)} {_np(rng)}"
    elif k == 7:
        s = f"{name} {rng.choice(INTRANS)} because {_np(rng)} was {rng.choice(ADJS)}"
    else:
        s = f"When {name} {rng.choice(VERBS)} {_np(rng)} , {name2} {rng.choice(INTRANS)} {rng.choice(ADVS)}"
    s = s[0].upper() + s[1:]
    s = s.replace(" ,", ",")
    return s + "."


def filler_text(n_tokens: int, seed: int | random.Random = 0) -> str:
    """Filler sentences totalling at least ``n_tokens`` tokens (by :func:`count_tokens`)."""
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    out: list[str] = []
    total = 0
    while total < n_tokens:
        s = filler_sentence(rng)
        out.append(s)
        total += count_tokens(s)
    return " ".join(out)


def write_haystack(path: str | Path = HAYSTACK_PATH, n_tokens: int = 40_000, seed: int = 1234) -> Path:
    """(Re)write the bundled haystack file: filler paragraphs of about ``n_tokens`` tokens."""
    rng = random.Random(seed)
    paras = []
    total = 0
    while total < n_tokens:
        p = filler_text(rng.randint(60, 160), rng)
        paras.append(p)
        total += count_tokens(p)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    return path


def haystack_text(path: str | Path | None = None) -> str:
    """The haystack text: the bundled file (or ``path``), with whitespace runs collapsed to one space."""
    p = Path(path) if path is not None else HAYSTACK_PATH
    if not p.exists() and path is None:
        write_haystack(p)
    return " ".join(p.read_text(encoding="utf-8").split())


# ----------------------------------------------------------------------------------------------------
# Needle in a haystack
# ----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def max_distractors() -> int:
    """The most distractor needles :func:`niah_example` can give one example: distinct needle subjects (the
    text before " is " of a generated needle) but one, the needle's own."""
    keys = set()
    for tmpl, _, kind in _NEEDLE_TEMPLATES:
        if kind == "place":
            subjects: Sequence[str] = [*PLACES, *PLACE_PAIRS]
        elif kind == "object":
            subjects = [f"{a} {o}" for a in ADJS for o in NEEDLE_OBJECTS]
        else:
            subjects = NAMES
        keys.update(tmpl.format(s=subj, v="x").split(" is ")[0] for subj in subjects)
    return len(keys) - 1


def random_needle(rng: random.Random, exclude_subjects: Sequence[str] = ()) -> tuple[str, str, str]:
    """A random (needle, question, answer) in the style of the reference needles (training data)."""
    while True:
        tmpl, q, kind = rng.choice(_NEEDLE_TEMPLATES)
        if kind == "place":
            subj = rng.choice(PLACES + PLACE_PAIRS) if rng.random() < 0.9 else rng.choice(PLACE_PAIRS)
        elif kind == "object":
            subj = f"{rng.choice(ADJS)} {rng.choice(NEEDLE_OBJECTS)}"
        else:
            subj = rng.choice(NAMES)
        if subj not in exclude_subjects:
            break
    if rng.random() < 0.4:  # a phrase with function words, like "eat a sandwich and sit in Dolores Park"
        answer = _activity(rng)
    else:
        n = rng.choice((1, 2, 2, 3, 3, 4, 5, 6, 8))
        pool = NEEDLE_WORDS + NOUNS + ADJS + PLACES
        answer = " ".join(rng.choice(pool) for _ in range(n))
    return tmpl.format(s=subj, v=answer), q.format(s=subj), answer


_ACTIVITY_VERBS = "eat sit ride read visit watch climb swim dance".split()


def _activity(rng: random.Random) -> str:
    """A short activity phrase: 'eat a sandwich', 'ride a red bicycle and sit in Oslo Park', ..."""
    def part() -> str:
        v = rng.choice(_ACTIVITY_VERBS)
        r = rng.random()
        if r < 0.4:
            return f"{v} a {rng.choice(NOUNS + ['sandwich', 'bicycle', 'picnic'])}"
        if r < 0.7:
            return f"{v} in {rng.choice(PLACES + ['Dolores'])} {rng.choice(['Park', 'museum', 'garden', 'market'])}"
        return f"{v} the {rng.choice(ADJS)} {rng.choice(NOUNS)}"
    return part() if rng.random() < 0.3 else f"{part()} and {part()}"


def reference_context_lengths(lo: int = 128, hi: int = 2048, n: int = 20) -> list[int]:
    """``n`` context lengths linearly spaced in [lo, hi] (the reference grid has 20)."""
    if n == 1:
        return [hi]
    return [int(round(lo + (hi - lo) * i / (n - 1))) for i in range(n)]


def token_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the words and punctuation marks of ``text``."""
    return [m.span() for m in _TOKEN_RE.finditer(text)]


def niah(
    context_lengths: Sequence[int] | None = None,
    depths: Sequence[float] | None = None,
    needles: Sequence[tuple[str, str, str]] | None = None,
    *,
    haystack: str | None = None,
    length_fn: Callable[[str], int] | None = None,
    seed: int = 0,
    distractors: int = 0,
    random_offset: bool = False,
) -> list[dict]:
    """Needle in a haystack over the grid context_lengths x depths x needles.

    The haystack is cut so that haystack + needle measure ``context_length`` tokens by ``length_fn``
    (default :func:`count_tokens`; cut on word boundaries, so a subword tokenizer may land a few tokens
    off). The needle goes in at ``depth`` (0 = start, 1 = end of the context), moved back to the nearest
    sentence boundary. The prompt is ``"<context> Question: <question> Answer:"``.

    Defaults: the reference grid, 20 context lengths in [128, 2048] (:func:`reference_context_lengths`)
    x 10 depths 0, 1/9, ..., 1 x the 3 :data:`DEFAULT_NEEDLES`.

    Each dict: ``prompt``, ``target`` (``" " + answer``), ``answer``, ``needle``, ``question``,
    ``needle_span`` ([start, end) character offsets of the needle in the prompt),
    ``context_length``, ``depth``, ``needle_index``; plus ``distractor_spans`` when ``distractors`` > 0
    (other needles, different subjects, placed at random depths).
    """
    context_lengths = list(context_lengths) if context_lengths is not None else reference_context_lengths()
    depths = list(depths) if depths is not None else [i / 9 for i in range(10)]
    needles = list(needles) if needles is not None else list(DEFAULT_NEEDLES)
    length_fn = length_fn or count_tokens
    hay = haystack if haystack is not None else haystack_text()
    spans = token_spans(hay)
    rng = random.Random(seed)
    out = []
    for L in context_lengths:
        for d in depths:
            for ni, (needle, question, answer) in enumerate(needles):
                out.append(
                    niah_example(hay, spans, L, d, needle, question, answer, length_fn, rng,
                              distractors, random_offset, ni)
                )
    return out


def _cut(hay: str, spans: list[tuple[int, int]], start_tok: int, n_tok: int,
         length_fn: Callable[[str], int]) -> str:
    """Haystack text starting at token ``start_tok`` that measures ``n_tok`` tokens by ``length_fn``
    (exactly for :func:`count_tokens`; the longest word-boundary cut not over ``n_tok`` otherwise)."""
    if n_tok <= 0:
        return ""
    need = n_tok if length_fn is count_tokens else 3 * n_tok + 8
    if need + 1 > len(spans):
        reps = need // max(1, len(spans)) + 2
        hay = " ".join([hay] * reps)
        spans = token_spans(hay)
    start_tok = start_tok % max(1, len(spans) - need)

    def text_of(k: int) -> str:
        return hay[spans[start_tok][0]: spans[start_tok + k - 1][1]]

    if length_fn is count_tokens:
        return text_of(n_tok)
    lo, hi = 1, need  # largest k with length_fn(text_of(k)) <= n_tok
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length_fn(text_of(mid)) <= n_tok:
            lo = mid
        else:
            hi = mid - 1
    return text_of(lo)


def niah_example(hay, spans, L, depth, needle, question, answer, length_fn, rng, distractors,
                 random_offset, needle_index) -> dict:
    """One needle-in-a-haystack example: the needle placed at ``depth`` of an ``L``-token context cut from
    ``hay`` (word spans ``spans``), with its question and answer (also used by the tiny model's trainer)."""
    extra = []
    if distractors > max_distractors():
        raise ValueError(f"{distractors} distractors: the needle generator has {max_distractors() + 1} distinct "
                         f"subjects, so at most {max_distractors()} distractors differ from the needle and each other")
    if distractors:
        subjects = [needle]
        for _ in range(distractors):
            n2, _, _ = random_needle(rng)
            while any(n2.split(" is ")[0] == s.split(" is ")[0] for s in subjects):
                n2, _, _ = random_needle(rng)
            subjects.append(n2)
            extra.append(n2)
    n_hay = max(0, L - length_fn(needle) - sum(length_fn(e) for e in extra))
    start = rng.randrange(len(spans)) if random_offset else 0
    ctx = _cut(hay, spans, start, n_hay, length_fn)
    ctx_spans = token_spans(ctx)

    def insert_at(text: str, tspans, frac: float) -> int:
        """Character index of a sentence boundary at about ``frac`` of ``text``."""
        if not tspans:
            return 0
        i = min(len(tspans), int(round(frac * len(tspans))))
        # move back to just after a sentence end (a "." token), or to the start
        while i > 0 and text[tspans[i - 1][0]: tspans[i - 1][1]] not in (".", "?", "!"):
            i -= 1
        return 0 if i == 0 else tspans[i - 1][1]

    pieces = [(insert_at(ctx, ctx_spans, depth), needle, True)]
    for e in extra:
        pieces.append((insert_at(ctx, ctx_spans, rng.random()), e, False))
    pieces.sort(key=lambda p: (p[0], not p[2]))
    text = ""
    cursor = 0
    needle_span = None
    dspans = []
    for pos, sent, is_needle in pieces:
        seg = ctx[cursor:pos].strip()
        if seg:
            text += (" " if text else "") + seg
        start_c = len(text) + (1 if text else 0)
        text += (" " if text else "") + sent
        span = [start_c, start_c + len(sent)]
        if is_needle:
            needle_span = span
        else:
            dspans.append(span)
        cursor = pos
    rest = ctx[cursor:].strip()
    if rest:
        text += " " + rest
    prompt = f"{text} Question: {question} Answer:"
    assert prompt[needle_span[0]: needle_span[1]] == needle
    ex = {
        "prompt": prompt,
        "target": " " + answer,
        "answer": answer,
        "needle": needle,
        "question": question,
        "needle_span": needle_span,
        "context_length": int(L),
        "depth": float(depth),
        "needle_index": needle_index,
    }
    if distractors:
        ex["distractor_spans"] = dspans
    return ex


# ----------------------------------------------------------------------------------------------------
# Key-value retrieval
# ----------------------------------------------------------------------------------------------------


def kv_retrieval(
    n: int = 100,
    num_pairs: Sequence[int] | int = (4, 8, 16, 32, 64),
    *,
    value_len: int | tuple[int, int] = (1, 2),
    seed: int = 0,
) -> list[dict]:
    """Associative recall: ``"<k1> : <v1> , <k2> : <v2> , ... . <kq> :"`` -> ``" <vq>"``.

    Keys are distinct nouns; values are 1..2 two-digit numbers (one token each). ``n`` examples per
    entry of ``num_pairs``. Fields: ``prompt``, ``target``, ``answer``, ``pairs`` (list of [key, value]),
    ``query_key``, ``query_index``, ``num_pairs``, ``answer_span`` (character offsets of the queried
    value inside the prompt).
    """
    rng = random.Random(seed)
    sizes = [num_pairs] if isinstance(num_pairs, int) else list(num_pairs)
    vl = (value_len, value_len) if isinstance(value_len, int) else value_len
    out = []
    for m in sizes:
        for _ in range(n):
            out.append(kv_example(rng, m, vl))
    return out


def kv_example(rng: random.Random, m: int, vl: tuple[int, int]) -> dict:
    """One key-value retrieval example with ``m`` pairs and values of ``vl`` words."""
    if m > len(KEYS):
        raise ValueError(f"num_pairs={m} exceeds the {len(KEYS)} distinct keys")
    keys = rng.sample(KEYS, m)
    vals = [" ".join(rng.choice(NUMBERS) for _ in range(rng.randint(*vl))) for _ in keys]
    q = rng.randrange(m)
    parts = []
    spans = []
    pos = 0
    for i, (k, v) in enumerate(zip(keys, vals, strict=True)):
        item = f"{k} : {v}"
        parts.append(item)
        spans.append((pos + len(k) + 3, pos + len(item)))
        pos += len(item) + (3 if i < m - 1 else 0)
    body = " , ".join(parts)
    prompt = f"{body} . {keys[q]} :"
    return {
        "prompt": prompt,
        "target": " " + vals[q],
        "answer": vals[q],
        "pairs": [[k, v] for k, v in zip(keys, vals, strict=True)],
        "query_key": keys[q],
        "query_index": q,
        "num_pairs": m,
        "answer_span": list(spans[q]),
    }


# ----------------------------------------------------------------------------------------------------
# Repeated random tokens (induction)
# ----------------------------------------------------------------------------------------------------


def repeated_tokens(
    lengths: Sequence[int] = (10, 25, 50, 100, 200),
    n: int = 10,
    *,
    vocab: Sequence[str] | None = None,
    seed: int = 0,
) -> list[dict]:
    """Random words (default: from :func:`vocabulary`, punctuation excluded) repeated twice.

    Fields: ``words`` (the 2*length words), ``text`` (the words joined by spaces), ``length`` (length of
    one copy), ``prompt`` (``text`` without its last word) and ``target`` (``" " + last word``, the
    induction prediction). With the headlab-tiny tokenizer each word is one token, so token ``i`` of
    ``text`` (after BOS) is ``words[i]``; for other tokenizers pass single-token words as ``vocab``.
    """
    rng = random.Random(seed)
    pool = list(vocab) if vocab is not None else [w for w in vocabulary() if re.fullmatch(r"\w+", w)]
    out = []
    for length in lengths:
        for _ in range(n):
            seq = [rng.choice(pool) for _ in range(length)]
            words = seq + seq
            out.append({
                "words": words,
                "text": " ".join(words),
                "length": length,
                "prompt": " ".join(words[:-1]),
                "target": " " + words[-1],
            })
    return out


# ----------------------------------------------------------------------------------------------------
# Counterfactual context (context vs memory)
# ----------------------------------------------------------------------------------------------------

_CF_CONTEXTS = (
    "The capital of {c} is {a}.",
    "According to the latest news, the capital of {c} is {a}.",
    "In a new report, the capital of {c} is {a}.",
)


def _cf_question(country: str) -> str:
    return f"Question: What is the capital of {country}? Answer:"


def closed_book(facts: Sequence[tuple[str, str]] | None = None) -> list[dict]:
    """The fact table as closed-book questions: ``prompt`` -> ``target`` (the memorised capital)."""
    facts = list(facts) if facts is not None else list(FACTS)
    return [
        {"prompt": _cf_question(c), "target": " " + a, "answer": a, "country": c,
         "strength": "strong" if c in STRONG_COUNTRIES else "weak"}
        for c, a in facts
    ]


def counterfact(
    n: int | None = None,
    *,
    facts: Sequence[tuple[str, str]] | None = None,
    filler_sentences: tuple[int, int] = (0, 2),
    conflict: bool = True,
    seed: int = 0,
) -> list[dict]:
    """Contexts that contradict (``conflict=True``) or restate a memorised fact, then a question.

    Default ``n``: one example per fact. Fields: ``prompt`` (context + question), ``target``
    (``" " + context_answer``: the context-faithful answer), ``context`` (the passage), ``question``
    (the question alone: the prompt without context, for CAD), ``context_answer`` (what the context
    says), ``memory_answer`` (the memorised capital), ``country``, ``conflict`` (bool), ``strength``
    ("strong": mostly kept against context in training; "weak": mostly yields to context),
    ``context_span`` ([start, end) characters of the fact sentence in the prompt).
    """
    rng = random.Random(seed)
    facts = list(facts) if facts is not None else list(FACTS)
    capitals = [a for _, a in FACTS]
    order = list(range(len(facts)))
    if n is None:
        idx = order
    else:
        idx = [order[i % len(order)] for i in range(n)]
        rng.shuffle(idx)
    out = []
    for i in idx:
        c, mem = facts[i]
        ans = rng.choice([a for a in capitals if a != mem]) if conflict else mem
        sent = rng.choice(_CF_CONTEXTS).format(c=c, a=ans)
        pre = " ".join(filler_sentence(rng) for _ in range(rng.randint(*filler_sentences)))
        post = " ".join(filler_sentence(rng) for _ in range(rng.randint(*filler_sentences)))
        context = " ".join(p for p in (pre, sent, post) if p)
        q = _cf_question(c)
        s0 = context.index(sent)
        out.append({
            "prompt": f"{context} {q}",
            "target": " " + ans,
            "context": context,
            "question": q,
            "context_answer": ans,
            "memory_answer": mem,
            "country": c,
            "conflict": conflict,
            "strength": "strong" if c in STRONG_COUNTRIES else "weak",
            "context_span": [s0, s0 + len(sent)],
        })
    return out


# ----------------------------------------------------------------------------------------------------
# Emphasis (PASTA)
# ----------------------------------------------------------------------------------------------------

_PLAIN_EMPHASIS = (
    "The first statement is correct.",
    "Remember, the first statement is the right one.",
    "Note: the first statement is correct, the second one is not.",
)


def emphasis(n: int = 100, *, seed: int = 0, filler_sentences: tuple[int, int] = (0, 2)) -> list[dict]:
    """Two conflicting statements ``"<Name> lives in <A>. ... <Name> lives in <B>."``, then
    ``"Question: Where does <Name> live? Answer:"``. The model was trained that the later statement wins
    (answer B); emphasising the first statement with PASTA should flip the answer to A; saying so in
    plain text (``plain_emphasis_prompt``) should not.

    Fields: ``prompt`` (plain, no markers), ``prompt_marked`` (the first statement wrapped in
    ``<em>...</em>``), ``emphasis_spans`` (list of [start, end) character offsets of the emphasised
    statement in ``prompt``), ``target`` (``" " + A``: the answer when following the emphasis),
    ``emphasis_answer`` (A), ``default_answer`` (B, the recency answer), ``plain_emphasis_prompt`` (the
    prompt with a sentence saying the first statement is right, inserted before the question),
    ``name``.
    """
    rng = random.Random(seed)
    towns = PLACES
    out = []
    for _ in range(n):
        name = rng.choice(NAMES)
        a, b = rng.sample(towns, 2)
        s1 = f"{name} lives in {a}."
        s2 = f"{name} lives in {b}."
        mid = " ".join(filler_sentence(rng) for _ in range(rng.randint(*filler_sentences)))
        pre = " ".join(filler_sentence(rng) for _ in range(rng.randint(0, 1)))
        q = f"Question: Where does {name} live? Answer:"
        head = f"{pre} " if pre else ""
        body = f"{s1} {mid} {s2}" if mid else f"{s1} {s2}"
        prompt = f"{head}{body} {q}"
        start = len(head)
        marked = f"{head}<em>{s1}</em>{body[len(s1):]} {q}"
        plain = f"{head}{body} {rng.choice(_PLAIN_EMPHASIS)} {q}"
        out.append({
            "prompt": prompt,
            "prompt_marked": marked,
            "emphasis_spans": [[start, start + len(s1)]],
            "target": " " + a,
            "emphasis_answer": a,
            "default_answer": b,
            "plain_emphasis_prompt": plain,
            "name": name,
        })
    return out


def _self_check() -> None:  # pragma: no cover - debugging aid
    ex = niah([200], [0.5])[0]
    s, e = ex["needle_span"]
    assert ex["prompt"][s:e] == ex["needle"]
    assert math.isfinite(rouge1_recall("a b", "a"))
