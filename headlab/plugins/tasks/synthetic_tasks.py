"""Task kinds over the seeded synthetic generators of :mod:`headlab.plugins.tasks.synthetic`.

- ``niah``: needle in a haystack (Wu et al. 2024; docs/methods.md#retrieval-score). The grid is
  ``context_lengths x depths x needles``; the reference grid is ``context_lengths: {lo: 128, hi:
  2048, n: 20}, depths: 10, needles: 3``; the defaults here are a small grid the embedded model
  handles on a laptop CPU. ``spans["needle"]`` is the needle sentence, ``spans["answer"]`` the answer
  inside it (character offsets into the prompt).
- ``kv_retrieval``: ``key : value`` pairs, then one key; ``spans["answer"]`` is the queried value.
- ``counterfact``: a context contradicting a memorised fact, then the question (context vs memory);
  ``meta`` has ``context_answer`` and ``memory_answer`` for the ``context_memory`` metric.
- ``emphasis``: PASTA's setting (docs/methods.md#pasta): two conflicting statements; the first is
  emphasised. The generator's ``<em>...</em>`` markers are removed from the prompt and recorded as
  ``spans["emphasis"]`` (``emphasis: span``), or kept as visible text (``markers``), or replaced by a
  sentence saying the first statement is right (``instruction``).

Every task takes ``seed`` (added to the run seed). Where a generator measures text in tokens
(``niah``), the model's tokenizer (``ctx.tokenizer``) is used when there is one, else the word-level
count of the embedded model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from headlab.plugin import (
    ComponentConfig,
    Example,
    NonNegativeInt,
    PositiveInt,
    Probability,
    Seed,
    StrictModel,
    TaskContext,
    hookimpl,
)
from headlab.resources import TaskSize

from . import generators as S
from .files import TaskDataError, check_data_file, long_word, resolve_path, strip_tags, word_error


def length_function(tokenizer: Any) -> Callable[[str], int] | None:
    """Token count of a text under ``tokenizer`` (no special tokens); None without a tokenizer."""
    if tokenizer is None:
        return None

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return count


# --- niah ---------------------------------------------------------------------------------------------

class LengthRange(StrictModel):
    """``n`` context lengths evenly spaced in ``[lo, hi]`` (the reference grid: 128..2048, 20)."""

    lo: PositiveInt = 128
    hi: PositiveInt = 2048
    n: PositiveInt = 20

    @model_validator(mode="after")
    def _order(self) -> LengthRange:
        if self.hi < self.lo:
            raise ValueError("hi must be >= lo")
        return self


def _ordered(value: tuple[int, int]) -> tuple[int, int]:
    if value[0] > value[1]:
        raise ValueError(f"[lo, hi] with lo <= hi (got [{value[0]}, {value[1]}])")
    return value


FillerRange = Annotated[tuple[NonNegativeInt, NonNegativeInt], AfterValidator(_ordered)]
"""``[lo, hi]``: a number of filler sentences drawn in that range (lo <= hi)."""


class Needle(StrictModel):
    """A needle sentence, the question it answers and the answer (a phrase of the needle)."""

    needle: str = Field(min_length=1)
    question: str = Field(min_length=1)
    answer: str = Field(min_length=1)


class Niah(ComponentConfig):
    """Needle in a haystack over context lengths x depths x needles (retrieval heads)."""

    kind: Literal["niah"] = "niah"
    context_lengths: list[PositiveInt] | LengthRange = Field(
        default_factory=lambda: [128, 256, 512],
        description="haystack + needle length in tokens: a list, or {lo, hi, n} evenly spaced "
        "(reference: {lo: 128, hi: 2048, n: 20})")
    depths: list[Probability] | PositiveInt = Field(
        5, description="needle depths in [0, 1] (0 = start), or a count k for k evenly spaced depths "
        "0..1 (reference: 10)")
    needles: PositiveInt | list[Needle] = Field(
        3, description="the first k of the 3 reference needles, or a list of {needle, question, answer}")
    haystack: str | None = Field(None, description="haystack text file (default: the bundled haystack)")
    distractors: NonNegativeInt = Field(0, description="other needles (different subjects) at random depths")
    random_offset: bool = Field(False, description="start the haystack cut at a random token")
    n: PositiveInt | None = Field(None, description="use n examples spread evenly over the grid (all when unset)")
    seed: Seed = Field(0, description="offset added to the run seed")

    @field_validator("context_lengths")
    @classmethod
    def _lengths(cls, v: list[int] | LengthRange) -> list[int] | LengthRange:
        if isinstance(v, list) and (not v or any(x < 1 for x in v)):
            raise ValueError("context_lengths must be positive token counts")
        return v

    @field_validator("depths")
    @classmethod
    def _depths(cls, v: list[float] | int) -> list[float] | int:
        if isinstance(v, int) and v < 2:
            raise ValueError("a depth count must be >= 2 (or give a list such as [0.5])")
        if isinstance(v, list) and (not v or any(not 0.0 <= d <= 1.0 for d in v)):
            raise ValueError("depths are fractions of the context in [0, 1]")
        return v

    @field_validator("distractors")
    @classmethod
    def _distractors(cls, v: int) -> int:
        if v > S.max_distractors():
            raise ValueError(f"at most {S.max_distractors()} distractors: the needle generator has "
                             f"{S.max_distractors() + 1} distinct subjects, and distractors differ from the needle "
                             "and from each other")
        return v

    @field_validator("needles")
    @classmethod
    def _needles(cls, v: int | list[Needle]) -> int | list[Needle]:
        if isinstance(v, int) and not 1 <= v <= len(S.DEFAULT_NEEDLES):
            raise ValueError(f"needles: a count between 1 and {len(S.DEFAULT_NEEDLES)} or a list of needles")
        if isinstance(v, list) and not v:
            raise ValueError("needles: give at least one")
        return v

    def preflight(self) -> None:
        """Before a run's store is created: a haystack file over the data-file limit is refused by its size."""
        if self.haystack is not None:
            check_data_file(self.haystack, "niah", key="haystack")

    def example_fields(self) -> frozenset[str]:
        """The answer, the needle's spans and its place (for ``requires()`` checks)."""
        return frozenset({"target", "spans", "meta.context_length", "meta.depth", "meta.needle_index", "meta.answer",
                          "meta.question"})

    def size(self) -> TaskSize:
        """How many examples and how long, computed without building the grid (for the resource guard)."""
        cl = self.context_lengths
        n_lengths, longest = (cl.n, cl.hi) if isinstance(cl, LengthRange) else (len(cl), max(cl))
        n_depths = self.depths if isinstance(self.depths, int) else len(self.depths)
        n_needles = self.needles if isinstance(self.needles, int) else len(self.needles)
        grid = n_lengths * n_depths * n_needles
        return TaskSize(min(self.n, grid) if self.n is not None else grid, longest + 64 * (1 + self.distractors))

    def grid(self) -> tuple[list[int], list[float], list[tuple[str, str, str]]]:
        """The resolved (context lengths, depths, needles)."""
        cl = self.context_lengths
        lengths = S.reference_context_lengths(cl.lo, cl.hi, cl.n) if isinstance(cl, LengthRange) else list(cl)
        d = self.depths
        depths = [i / (d - 1) for i in range(d)] if isinstance(d, int) else list(d)
        if isinstance(self.needles, int):
            needles = list(S.DEFAULT_NEEDLES[: self.needles])
        else:
            needles = [(x.needle, x.question, x.answer) for x in self.needles]
        return lengths, depths, needles


def build_niah(config: Niah, ctx: TaskContext) -> list[Example]:
    """Generate the grid and convert it to Examples."""
    lengths, depths, needles = config.grid()
    haystack = None
    if config.haystack is not None:
        path = resolve_path(config.haystack, "niah")
        haystack = S.haystack_text(path)
        if not haystack:
            raise TaskDataError(f"niah task: haystack file {config.haystack!r} is empty")
        if long_word(haystack) is not None:  # located in the file as written (haystack_text joins its lines)
            raw = path.read_text(encoding="utf-8")
            offset, length = long_word(raw) or (0, 0)
            line = raw.count("\n", 0, offset) + 1
            raise TaskDataError(word_error(f"niah task: haystack file {config.haystack!r} line {line}",
                                           (offset - raw.rfind("\n", 0, offset) - 1, length), "column"))
    rows = S.niah(lengths, depths, needles, haystack=haystack, length_fn=length_function(ctx.tokenizer),
                  seed=ctx.seed + config.seed, distractors=config.distractors,
                  random_offset=config.random_offset)
    if config.n is not None:
        if config.n > len(rows):
            raise TaskDataError(f"niah task: n={config.n} exceeds the grid ({len(rows)} examples: "
                                f"{len(lengths)} lengths x {len(depths)} depths x {len(needles)} needles)")
        rows = [rows[(i * len(rows)) // config.n] for i in range(config.n)]
    out = []
    for r in rows:
        s, e = r["needle_span"]
        spans: dict[str, list[tuple[int, int]]] = {"needle": [(s, e)]}
        at = r["needle"].rfind(r["answer"])
        if at >= 0:
            spans["answer"] = [(s + at, s + at + len(r["answer"]))]
        if r.get("distractor_spans"):
            spans["distractor"] = [(a, b) for a, b in r["distractor_spans"]]
        out.append(Example(
            prompt=r["prompt"], target=r["target"], spans=spans,
            meta={"context_length": r["context_length"], "depth": r["depth"],
                  "needle_index": r["needle_index"], "answer": r["answer"], "question": r["question"]},
        ))
    return out


# --- kv_retrieval ---------------------------------------------------------------------------------

class KvRetrieval(ComponentConfig):
    """Key-value retrieval: 'k1 : v1 , k2 : v2 , ... . kq :' -> ' vq' (associative recall)."""

    kind: Literal["kv_retrieval"] = "kv_retrieval"
    n: PositiveInt = Field(8, description="examples per entry of num_pairs")
    num_pairs: PositiveInt | list[PositiveInt] = Field(default_factory=lambda: [4, 8, 16],
                                       description="pairs per prompt (one value or several)")
    value_len: PositiveInt | tuple[PositiveInt, PositiveInt] = Field((1, 2), description="numbers per value: k or [lo, hi]")
    seed: Seed = Field(0, description="offset added to the run seed")

    @field_validator("num_pairs")
    @classmethod
    def _pairs(cls, v: int | list[int]) -> int | list[int]:
        sizes = [v] if isinstance(v, int) else v
        if not sizes or any(not 1 <= m <= len(S.KEYS) for m in sizes):
            raise ValueError(f"num_pairs must be between 1 and {len(S.KEYS)} (the distinct keys)")
        return v

    @field_validator("value_len")
    @classmethod
    def _vlen(cls, v: int | tuple[int, int]) -> int | tuple[int, int]:
        lo, hi = (v, v) if isinstance(v, int) else v
        if not 1 <= lo <= hi:
            raise ValueError("value_len: 1 <= lo <= hi")
        return v


    def example_fields(self) -> frozenset[str]:
        """The value asked for, its span and the query (for ``requires()`` checks)."""
        return frozenset({"target", "spans", "meta.num_pairs", "meta.query_index", "meta.query_key", "meta.answer"})

    def size(self) -> TaskSize:
        """``n`` examples per entry of ``num_pairs``; a pair is a key, a colon, the value and a comma."""
        sizes = [self.num_pairs] if isinstance(self.num_pairs, int) else self.num_pairs
        hi = self.value_len if isinstance(self.value_len, int) else self.value_len[1]
        return TaskSize(self.n * len(sizes), 16 + max(sizes) * (hi + 4))


def build_kv(config: KvRetrieval, ctx: TaskContext) -> list[Example]:
    """Generate key-value prompts."""
    rows = S.kv_retrieval(config.n, config.num_pairs, value_len=config.value_len, seed=ctx.seed + config.seed)
    return [Example(prompt=r["prompt"], target=r["target"], spans={"answer": [tuple(r["answer_span"])]},
                    meta={"num_pairs": r["num_pairs"], "query_index": r["query_index"],
                          "query_key": r["query_key"], "answer": r["answer"]})
            for r in rows]


# --- counterfact ----------------------------------------------------------------------------------

class Counterfact(ComponentConfig):
    """Contexts that contradict memorised facts, then the question (context vs memory)."""

    kind: Literal["counterfact"] = "counterfact"
    n: PositiveInt | None = Field(None, description="number of examples (default: one per fact)")
    conflict: bool = Field(True, description="the context contradicts the fact (false: it restates it)")
    closed_book: bool = Field(False, description="no context: the question alone, target = the memorised fact")
    strength: Literal["all", "strong", "weak"] = Field(
        "all", description="only facts the embedded model keeps against context (strong) or yields (weak)")
    filler_sentences: FillerRange = Field((0, 2), description="filler sentences before/after the fact: [lo, hi]")
    seed: Seed = Field(0, description="offset added to the run seed")


    def example_fields(self) -> frozenset[str]:
        """The context's and the memorised answer (closed book: the memorised one only), for ``requires()`` checks."""
        if self.closed_book:
            return frozenset({"target", "meta.memory_answer", "meta.country", "meta.strength"})
        return frozenset({"target", "spans", "meta.context_answer", "meta.memory_answer", "meta.country",
                          "meta.conflict", "meta.strength", "meta.question"})

    def size(self) -> TaskSize:
        """One example per fact (or ``n``); filler sentences are at most 32 tokens each."""
        return TaskSize(self.n or len(S.FACTS), 96 + 2 * 32 * self.filler_sentences[1])


def build_counterfact(config: Counterfact, ctx: TaskContext) -> list[Example]:
    """Generate context-vs-memory questions."""
    facts = [f for f in S.FACTS if config.strength == "all"
             or (f[0] in S.STRONG_COUNTRIES) == (config.strength == "strong")]
    if config.closed_book:
        rows = S.closed_book(facts)
        rows = rows[: config.n] if config.n is not None else rows
        return [Example(prompt=r["prompt"], target=r["target"],
                        meta={"memory_answer": r["answer"], "country": r["country"], "strength": r["strength"]})
                for r in rows]
    rows = S.counterfact(config.n, facts=facts, filler_sentences=config.filler_sentences,
                         conflict=config.conflict, seed=ctx.seed + config.seed)
    return [Example(prompt=r["prompt"], target=r["target"], spans={"context": [tuple(r["context_span"])]},
                    meta={"context_answer": r["context_answer"], "memory_answer": r["memory_answer"],
                          "country": r["country"], "conflict": r["conflict"], "strength": r["strength"],
                          "question": r["question"]})
            for r in rows]


# --- emphasis -------------------------------------------------------------------------------------

class Emphasis(ComponentConfig):
    """Two conflicting statements, the first emphasised (PASTA); the later one wins by default."""

    kind: Literal["emphasis"] = "emphasis"
    n: PositiveInt = Field(32, description="number of examples")
    emphasis: Literal["span", "markers", "instruction"] = Field(
        "span", description="span: <em> markers removed, recorded in spans['emphasis'] (for steering); "
        "markers: <em>...</em> kept in the prompt as plain text; instruction: a sentence saying the first "
        "statement is correct")
    filler_sentences: FillerRange = Field((0, 2), description="filler sentences between the statements: [lo, hi]")
    seed: Seed = Field(0, description="offset added to the run seed")


    def example_fields(self) -> frozenset[str]:
        """The emphasised and the default answer, the emphasis span (for ``requires()`` checks)."""
        return frozenset({"target", "spans", "meta.emphasis_answer", "meta.default_answer", "meta.name"})

    def size(self) -> TaskSize:
        """``n`` examples; filler sentences are at most 32 tokens each."""
        return TaskSize(self.n, 128 + 32 * self.filler_sentences[1])


def build_emphasis(config: Emphasis, ctx: TaskContext) -> list[Example]:
    """Generate emphasis examples."""
    rows = S.emphasis(config.n, seed=ctx.seed + config.seed, filler_sentences=config.filler_sentences)
    out = []
    for r in rows:
        stripped, spans = strip_tags(r["prompt_marked"], {"emphasis": "em"})
        if config.emphasis == "span":
            prompt = stripped
        elif config.emphasis == "markers":
            prompt = r["prompt_marked"]
            # the k-th span is shifted by the k pairs of tags before it and its own opening tag
            shift = [len("<em></em>") * k + len("<em>") for k in range(len(spans["emphasis"]))]
            spans = {"emphasis": [(s + d, e + d) for (s, e), d in zip(spans["emphasis"], shift, strict=True)]}
        else:
            prompt = r["plain_emphasis_prompt"]  # starts with the same text as the plain prompt
        out.append(Example(prompt=prompt, target=r["target"], spans=spans,
                           meta={"emphasis_answer": r["emphasis_answer"], "default_answer": r["default_answer"],
                                 "name": r["name"]}))
    return out


@hookimpl
def headlab_register_tasks(register):
    register(Niah, build_niah)
    register(KvRetrieval, build_kv)
    register(Counterfact, build_counterfact)
    register(Emphasis, build_emphasis)
