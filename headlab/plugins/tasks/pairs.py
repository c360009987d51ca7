"""Pair tasks: clean and corrupted prompts with an answer and a wrong answer, for causal head analysis.

Definition: docs/methods.md#metrics-for-circuit-analysis. Every example is a pair of prompts of the same
token length: ``prompt`` is the clean prompt, ``meta["corrupt_prompt"]`` the corrupted one; ``target`` is the
answer as a continuation (``target_delimiter + answer``) and ``choices`` are ``[answer, wrong]`` the same
way (``label`` 0). ``meta`` also holds ``answer`` / ``wrong`` (the texts) and ``answer_id`` / ``wrong_id``:
the one token that each continues the clean prompt with (the tokens of ``prompt + delimiter + answer``
after those of ``prompt``), the token whose logit the metric ``logit[answer] - logit[wrong]`` reads.

Kinds:

- ``pairs``: records of a JSON Lines or CSV file with the fields ``clean``, ``corrupt``, ``answer``,
  ``wrong``;
- ``kv_swap``: the key-value retrieval prompts of ``kv_retrieval`` (one-number values), corrupted by
  querying another key of the same context; the wrong answer is that key's value;
- ``repeated_pairs``: a random sequence of distinct words followed by the start of its repeat (the induction
  probe of ``repeated_tokens``), the clean prompt ending at a word of the second copy; the answer is the word
  that followed it in the first copy; the corrupted prompt replaces that word of the first copy by another
  word (outside the sequence), which is the wrong answer;
- ``ioi_pairs``: indirect-object identification from templates (Wang et al. 2022): "When A and B went to
  the place, B gave an object to" -> " A"; the corrupted prompt swaps the names in the second clause
  (" B" is then the answer), the wrong answer is " B".

A pair whose prompts tokenize to different lengths, or whose answer is not one token, is an error naming
the pair (file and row, or the generated example's index) and the token counts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, field_validator

from headlab.plugin import ComponentConfig, Example, PositiveInt, Seed, TaskContext, hookimpl
from headlab.plugins.tasks import generators as S
from headlab.plugins.tasks.files import DataSource, TaskDataError
from headlab.resources import TaskSize

__all__ = [
    "FIELDS", "IOI_TEMPLATES", "PAIR_FIELDS", "IoiPairs", "KvSwap", "PairTask", "RepeatedPairs", "answer_token", "build_ioi",
    "build_kv_swap", "build_pairs", "build_repeated_pairs", "pair_example",
]

#: the fields of a record of a ``pairs`` file
FIELDS = ("clean", "corrupt", "answer", "wrong")
PAIR_FIELDS = frozenset({"target", "choices", "label", "meta.corrupt_prompt", "meta.answer", "meta.wrong",
                         "meta.answer_id", "meta.wrong_id"})
"""The example fields of every pair (:func:`pair_example`), as a task's ``example_fields()`` names them."""

#: the default IOI templates: ``{A}`` the indirect object (the answer), ``{B}`` the subject, ``{place}``,
#: ``{object}``; the clean prompt names ``{B}`` in the second clause, the corrupted one ``{A}``
IOI_TEMPLATES = (
    "When {A} and {B} went to the {place}, {B} gave a {object} to",
    "Then, {A} and {B} had a long talk at the {place}. {B} handed the {object} to",
    "After {A} and {B} walked into the {place}, {B} offered a {object} to",
)
_IOI_PLACES = ("market", "garden", "village", "kitchen", "library", "forest", "museum", "island")
_IOI_OBJECTS = ("book", "letter", "lamp", "candle", "pencil", "song", "story", "paper")


def _ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as :func:`headlab.tokenize` makes them (special tokens added)."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def answer_token(tokenizer: Any, prompt: str, continuation: str, where: str, what: str = "answer") -> int:
    """The one token that ``continuation`` (delimiter included) adds after ``prompt``; an error naming
    ``where`` when it adds several, none, or the unknown token."""
    base, full = _ids(tokenizer, prompt), _ids(tokenizer, prompt + continuation)
    if full[: len(base)] != base:
        raise TaskDataError(f"{where}: the {what} {continuation!r} changes how the prompt itself tokenizes "
                            "(its tokens are not the prompt's followed by the answer's); check the delimiter")
    extra = full[len(base):]
    if len(extra) != 1:
        raise TaskDataError(f"{where}: the {what} {continuation!r} is {len(extra)} tokens after the prompt; "
                            "the logit difference needs a single-token answer")
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and extra[0] == unk and continuation.strip() != getattr(tokenizer, "unk_token", None):
        raise TaskDataError(f"{where}: the {what} {continuation!r} is the tokenizer's unknown token")
    return int(extra[0])


def pair_example(tokenizer: Any, clean: str, corrupt: str, answer: str, wrong: str, where: str, *,
                 delimiter: str = " ", meta: dict[str, Any] | None = None) -> Example:
    """One pair as an :class:`~headlab.Example` (see the module docstring), checked: equal token lengths
    of the two prompts and single-token answers; errors name ``where`` (e.g. ``pairs.jsonl row 3``)."""
    n_clean, n_corrupt = len(_ids(tokenizer, clean)), len(_ids(tokenizer, corrupt))
    if n_clean != n_corrupt:
        raise TaskDataError(f"{where}: the clean prompt is {n_clean} tokens and the corrupted one {n_corrupt}; "
                            "a pair needs prompts of equal token length")
    answer_id = answer_token(tokenizer, clean, delimiter + answer, where, "answer")
    wrong_id = answer_token(tokenizer, clean, delimiter + wrong, where, "wrong answer")
    if answer_id == wrong_id:
        raise TaskDataError(f"{where}: the answer {answer!r} and the wrong answer {wrong!r} are the same token")
    info = {**(meta or {}), "corrupt_prompt": corrupt, "answer": answer, "wrong": wrong, "answer_id": answer_id,
            "wrong_id": wrong_id}
    return Example(prompt=clean, target=delimiter + answer, choices=[delimiter + answer, delimiter + wrong],
                   label=0, meta=info)


# --- pairs from a file ---------------------------------------------------------------------------------

class PairTask(DataSource):
    """Clean / corrupted prompt pairs with an answer and a wrong answer, from a JSON Lines or CSV file."""

    kind: Literal["pairs"] = "pairs"
    target_delimiter: str = Field(" ", description="put in front of the answer and the wrong answer")
    delimiter: str = Field(",", min_length=1, max_length=1, description="CSV cell delimiter ('\\t' for TSV)")

    def example_fields(self) -> frozenset[str]:
        """A pair's fields and the data row (for ``requires()`` checks)."""
        return PAIR_FIELDS | {"meta.row"}


def build_pairs(config: PairTask, ctx: TaskContext) -> list[Example]:
    """One example per record of the file (fields ``clean``, ``corrupt``, ``answer``, ``wrong``)."""
    tok = ctx.require_tokenizer(config.kind)
    examples = []
    for row in config.rows(ctx, delimiter=config.delimiter):
        where = f"{config.kind} task: {row.where()}"
        missing = [f for f in FIELDS if row.data.get(f) in (None, "")]
        if missing:
            raise TaskDataError(f"{where}: missing field(s) {', '.join(missing)} (a pair needs "
                                f"{', '.join(FIELDS)})")
        clean, corrupt, answer, wrong = (str(row.data[f]) for f in FIELDS)
        examples.append(pair_example(tok, clean, corrupt, answer, wrong, where, delimiter=config.target_delimiter,
                                     meta={"row": row.number}))
    return examples


# --- key-value retrieval with the key swapped ----------------------------------------------------------

class KvSwap(ComponentConfig):
    """Key-value retrieval pairs: the corrupted prompt queries another key of the same context."""

    kind: Literal["kv_swap"] = "kv_swap"
    n: PositiveInt = Field(8, description="number of pairs")
    num_pairs: PositiveInt = Field(6, description="key-value pairs per prompt (at least 2)")
    seed: Seed = Field(0, description="offset added to the run seed")

    @field_validator("num_pairs")
    @classmethod
    def _pairs(cls, v: int) -> int:
        if not 2 <= v <= len(S.KEYS):
            raise ValueError(f"num_pairs must be between 2 and {len(S.KEYS)} (the distinct keys)")
        return v

    def example_fields(self) -> frozenset[str]:
        """A pair's fields and the keys (for ``requires()`` checks)."""
        return PAIR_FIELDS | {"meta.query_key", "meta.swap_key", "meta.num_pairs"}

    def size(self) -> TaskSize:
        """``n`` examples; a pair is a key, a colon, the value and a comma."""
        return TaskSize(self.n, 8 + 4 * self.num_pairs)


def build_kv_swap(config: KvSwap, ctx: TaskContext) -> list[Example]:
    """``n`` pairs ``"k1 : v1 , ... . kq :"`` -> ``vq`` (clean) / ``"... . kr :"`` -> ``vr`` (corrupted)."""
    tok = ctx.require_tokenizer(config.kind)
    rng = random.Random(ctx.seed + config.seed)
    examples = []
    for i in range(config.n):
        for _ in range(100):  # redraw a context whose other keys all hold the queried value
            row = S.kv_example(rng, config.num_pairs, (1, 1))
            values, q = dict(row["pairs"]), row["query_key"]
            others = [k for k, v in row["pairs"] if k != q and v != values[q]]
            if others:
                break
        else:
            raise TaskDataError(f"kv_swap task: example {i}: no second key with a different value in 100 draws")
        swap = rng.choice(others)
        clean = row["prompt"]
        corrupt = clean[: len(clean) - len(q) - 2] + f"{swap} :"
        examples.append(pair_example(tok, clean, corrupt, values[q], values[swap], f"kv_swap task: example {i}",
                                     meta={"query_key": q, "swap_key": swap, "num_pairs": config.num_pairs}))
    return examples


# --- repeated tokens with the first copy corrupted --------------------------------------------------------

class RepeatedPairs(ComponentConfig):
    """Repeated random words: the clean prompt repeats a word of the sequence, the corrupted one changes the word
    that followed it in the first copy."""

    kind: Literal["repeated_pairs"] = "repeated_pairs"
    n: PositiveInt = Field(8, description="number of pairs")
    length: PositiveInt = Field(12, description="words in the random sequence (the first copy), at least 2")
    words: list[str] | None = Field(
        None, description="words to draw from (each must be one token after a space); default: the nouns of the "
        "embedded model's grammar that are one token for the model's tokenizer")
    seed: Seed = Field(0, description="offset added to the run seed")

    @field_validator("length")
    @classmethod
    def _length(cls, v: int) -> int:
        if v < 2:
            raise ValueError("length must be at least 2 (a repeated word and the word after it)")
        return v

    @field_validator("words")
    @classmethod
    def _words(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not w or w != w.strip() or " " in w for w in v):
            raise ValueError("words: each must be one word without spaces")
        return v

    def example_fields(self) -> frozenset[str]:
        """A pair's fields and the repeat's place (for ``requires()`` checks)."""
        return PAIR_FIELDS | {"meta.length", "meta.repeat_index", "meta.corrupt_index"}

    def size(self) -> TaskSize:
        """``n`` examples of at most ``2 x length`` words (and a BOS token)."""
        return TaskSize(self.n, 1 + 2 * self.length)


def _single_token_words(tok: Any, words: Sequence[str], strict: bool, kind: str) -> list[str]:
    """The distinct ``words`` that are one token after ``"The "``; ``strict``: a word that is not is an error."""
    out = []
    for word in dict.fromkeys(words):
        try:
            answer_token(tok, "The", " " + word, f"{kind} task: word {word!r}", "word")
        except TaskDataError:
            if strict:
                raise
            continue
        out.append(word)
    return out


def build_repeated_pairs(config: RepeatedPairs, ctx: TaskContext) -> list[Example]:
    """``n`` pairs ``"s_0 ... s_{L-1} s_0 ... s_j"`` -> ``s_{j+1}`` (clean) / the same with ``s_{j+1}`` of the
    first copy replaced by a word ``c`` outside the sequence -> ``c`` (corrupted; the wrong answer); ``j``
    drawn in ``0..L-2``."""
    tok = ctx.require_tokenizer(config.kind)
    pool = _single_token_words(tok, config.words or S.NOUNS, config.words is not None, config.kind)
    if len(pool) < config.length + 1:
        raise TaskDataError(f"{config.kind} task: {len(pool)} single-token words for sequences of {config.length} "
                            f"distinct words and a replacement; give more `words:` or a smaller `length:`")
    rng = random.Random(ctx.seed + config.seed)
    examples = []
    for i in range(config.n):
        seq = rng.sample(pool, config.length + 1)
        first, replacement = seq[:-1], seq[-1]
        j = rng.randrange(config.length - 1)
        corrupted = first[:j + 1] + [replacement] + first[j + 2:]
        clean = " ".join(first + first[:j + 1])
        corrupt = " ".join(corrupted + first[:j + 1])
        examples.append(pair_example(tok, clean, corrupt, first[j + 1], replacement,
                                     f"{config.kind} task: example {i}",
                                     meta={"length": config.length, "repeat_index": j, "corrupt_index": j + 1}))
    return examples


# --- indirect object identification ----------------------------------------------------------------------

class IoiPairs(ComponentConfig):
    """IOI pairs from templates; the corrupted prompt swaps the names of the second clause."""

    kind: Literal["ioi_pairs"] = "ioi_pairs"
    n: PositiveInt = Field(8, description="number of pairs")
    names: list[str] | None = Field(
        None, description="names to draw A and B from (each must be one token after the delimiter); default: "
        "a built-in list, keeping the names that are one token for the model's tokenizer")
    templates: list[str] = Field(default_factory=lambda: list(IOI_TEMPLATES), min_length=1, description=(
        "templates with {A} (indirect object), {B} (subject, named twice), and optionally {place}, {object}"))
    places: list[str] = Field(default_factory=lambda: list(_IOI_PLACES), min_length=1)
    objects: list[str] = Field(default_factory=lambda: list(_IOI_OBJECTS), min_length=1)
    target_delimiter: str = Field(" ", description="put in front of the names as answers")
    seed: Seed = Field(0, description="offset added to the run seed")

    @field_validator("templates")
    @classmethod
    def _templates(cls, v: list[str]) -> list[str]:
        for t in v:
            if t.count("{A}") != 1 or t.count("{B}") != 2 or t.index("{A}") > t.index("{B}"):
                raise ValueError(f"IOI template {t!r} must name {{A}} once, then {{B}} twice "
                                 "(the second {B} is the subject the corrupted prompt swaps)")
            try:
                t.format(A="", B="", place="", object="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"IOI template {t!r}: only {{A}}, {{B}}, {{place}} and {{object}} may be used "
                                 f"({e})") from None
        return v

    @field_validator("names")
    @classmethod
    def _names(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(set(v)) < 2:
            raise ValueError("names: give at least two different names")
        return v

    def example_fields(self) -> frozenset[str]:
        """A pair's fields and the template's index (for ``requires()`` checks)."""
        return PAIR_FIELDS | {"meta.template"}

    def size(self) -> TaskSize:
        """``n`` examples of about two tokens per word of the longest template."""
        return TaskSize(self.n, 8 + 2 * max(len(t.split()) for t in self.templates))


def _single_token_names(tok: Any, names: Sequence[str], delimiter: str, strict: bool) -> list[str]:
    """The names that are one token after ``"The" + delimiter``; ``strict``: a name that is not is an error."""
    out = []
    for name in dict.fromkeys(names):
        try:
            answer_token(tok, "The", delimiter + name, f"ioi_pairs task: name {name!r}", "name")
        except TaskDataError:
            if strict:
                raise
            continue
        out.append(name)
    return out


def build_ioi(config: IoiPairs, ctx: TaskContext) -> list[Example]:
    """``n`` IOI pairs: the template filled with two different names, a place and an object."""
    tok = ctx.require_tokenizer(config.kind)
    names = _single_token_names(tok, config.names or S.NAMES, config.target_delimiter, config.names is not None)
    if len(names) < 2:
        raise TaskDataError("ioi_pairs task: fewer than two of the built-in names are one token for this "
                            "tokenizer; give `names:`")
    rng = random.Random(ctx.seed + config.seed)
    examples = []
    for i in range(config.n):
        template = config.templates[i % len(config.templates)]
        a, b = rng.sample(names, 2)
        fill = {"place": rng.choice(config.places), "object": rng.choice(config.objects)}
        clean = template.format(A=a, B=b, **fill)
        cut = template.rindex("{B}")
        corrupt = (template[:cut].format(A=a, B=b, **fill) + a + template[cut + 3:].format(A=a, B=b, **fill))
        examples.append(pair_example(tok, clean, corrupt, a, b, f"ioi_pairs task: example {i}",
                                     delimiter=config.target_delimiter, meta={"template": i % len(config.templates)}))
    return examples


@hookimpl
def headlab_register_tasks(register):
    register(PairTask, build_pairs)
    register(KvSwap, build_kv_swap)
    register(RepeatedPairs, build_repeated_pairs)
    register(IoiPairs, build_ioi)
