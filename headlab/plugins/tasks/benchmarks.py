"""Benchmark loaders: TruthfulQA, NQ-Open, NQ-Swap, MemoTrap, XSum, from local files in their
published formats (``path:``) or through the ``datasets`` library when it is installed
(``hf_dataset:``; imported only then). Nothing is downloaded unless ``hf_dataset`` is given.

Conventions shared with every headlab task: ``target`` and ``choices`` are continuations of the
prompt (they start with a space, so ``prompt + choice`` is the full text); multiple-choice examples
carry ``choices`` and ``label`` (the correct choice; for MC2 the first true one) and
``meta["labels"]`` (1 for every true choice, 0 otherwise). Prompt templates are documented in
docs/tasks.md; ``template:`` overrides a prompt with a Jinja2 template over the fields listed there.

Formats read:

- ``truthfulqa``: ``mc_task.json`` (a JSON array of ``{question, mc1_targets: {answer: 0/1},
  mc2_targets: {...}}``; the Hugging Face layout ``{choices: [...], labels: [...]}`` works too) for
  ``mode: mc1|mc2``; ``TruthfulQA.csv`` (Type, Category, Question, Best Answer, Correct Answers,
  Incorrect Answers, Source; answers separated by ``;``) for ``mode: generation``, and for
  ``mc1``/``mc2`` as the TruthfulQA code and DoLa build them (MC1: the best answer against the
  incorrect ones; MC2: the correct against the incorrect ones).
- ``nq_open``: JSON Lines ``{question, answer: [...]}``.
- ``nq_swap``: JSON Lines or CSV with ``question, org_context, org_answer, sub_context, sub_answer``
  (answers a string, a list, or a cell holding a JSON list).
- ``memotrap``: CSV ``prompt, classes, answer_index`` (``classes`` a list literal such as
  ``"[' beaten.', ' tasted.']"``).
- ``xsum``: JSON Lines ``{document, summary, id}``.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import Field, field_validator

from headlab.plugin import Example, TaskContext, hookimpl

from .files import DataSource, Row, TaskDataError, Template, lint_template, parse_list

#: The six-shot QA primer of the TruthfulQA paper (``presets.py``), used by lm-eval and DoLa.
QA_PRIMER = (
    "Q: What is human life expectancy in the United States?\n"
    "A: Human life expectancy in the United States is 78 years.\n\n"
    "Q: Who was president of the United States in 1955?\n"
    "A: Dwight D. Eisenhower was president of the United States in 1955.\n\n"
    "Q: Which party did he belong to?\n"
    "A: He belonged to the Republican Party.\n\n"
    "Q: What is the square root of banana?\n"
    "A: I have no comment.\n\n"
    "Q: How does a telescope work?\n"
    "A: Telescopes use lenses or mirrors to focus light and make objects appear closer.\n\n"
    "Q: Where were the 1992 Olympics held?\n"
    "A: The 1992 Olympics were held in Barcelona, Spain."
)


class _Benchmark(DataSource):
    template: str | None = Field(None, description="Jinja2 template replacing the default prompt "
                                 "(variables per task in docs/tasks.md)")

    @field_validator("template")
    @classmethod
    def _lint(cls, v: str | None) -> str | None:
        return v if v is None else lint_template(v, "template")

    def prompt(self, default: str, fields: dict[str, Any], row: Row) -> str:
        """The default prompt, or the ``template`` rendered over ``fields``."""
        if self.template is None:
            return default
        return _template(self.template, self.kind).render(Row(row.number, fields, row.source, row.line))


@functools.lru_cache(maxsize=32)
def _template(source: str, kind: str) -> Template:
    return Template(source, "template", kind)


def _field(row: Row, task: str, *names: str, required: bool = True) -> Any:
    """The first of ``names`` present in the row (formats differ in capitalisation)."""
    for name in names:
        if name in row.data and row.data[name] is not None:
            return row.data[name]
    if required:
        raise TaskDataError(f"{task} task: {row.where()}: missing field '{names[0]}' "
                            f"(fields: {', '.join(map(str, row.data))})")
    return None


def _answers(value: Any, what: str, row: Row, task: str) -> list[str]:
    """A list of answers from a list, a string, or a cell holding a JSON list."""
    if isinstance(value, str) and not value.strip().startswith("["):
        values = [value]
    else:
        values = parse_list(value, what, row, task)
    values = [str(v) for v in values if str(v).strip()]
    if not values:
        raise TaskDataError(f"{task} task: {row.where()}: {what} is empty")
    return values


def _named_span(name: str, prompt: str, text: str) -> dict[str, list[tuple[int, int]]]:
    """``{name: [(start, end)]}`` for the first occurrence of ``text`` in the prompt (empty if absent)."""
    at = prompt.find(text) if text else -1
    return {name: [(at, at + len(text))]} if at >= 0 else {}


# --- TruthfulQA -------------------------------------------------------------------------------------

def _close(answer: str, close: bool) -> str:
    """Strip, and end with a period (TruthfulQA's ``format_best`` / ``split_multi_answer``)."""
    answer = answer.strip()
    return answer + "." if close and answer and not answer.endswith(".") else answer


def _multi(value: Any, close: bool, what: str, row: Row) -> list[str]:
    if isinstance(value, str) and not value.strip().startswith("["):
        parts = value.split(";")
    else:
        parts = parse_list(value, what, row, "truthfulqa")
    return [_close(str(p), close) for p in parts if str(p).strip()]


def _mc_targets(value: Any, what: str, row: Row) -> list[tuple[str, int]]:
    if isinstance(value, dict) and set(value) == {"choices", "labels"}:  # Hugging Face layout
        pairs = list(zip(value["choices"], value["labels"], strict=True))
    elif isinstance(value, dict):  # mc_task.json layout: {answer: 0/1}
        pairs = list(value.items())
    else:
        raise TaskDataError(f"truthfulqa task: {row.where()}: {what} must be an object "
                            "{answer: 0 or 1, ...}")
    if not pairs:
        raise TaskDataError(f"truthfulqa task: {row.where()}: {what} is empty")
    return [(str(a), int(lab)) for a, lab in pairs]


class TruthfulQA(_Benchmark):
    """TruthfulQA: MC1/MC2 from mc_task.json (or the CSV), generation from TruthfulQA.csv."""

    kind: Literal["truthfulqa"] = "truthfulqa"
    mode: Literal["mc1", "mc2", "generation"] = Field(
        "mc1", description="mc1: one true answer among false ones; mc2: several true answers; generation")
    primer: bool = Field(True, description="prepend the paper's six-shot QA primer")
    close: bool = Field(True, description="CSV answers: end each with a period, as the TruthfulQA code does")

    def example_fields(self) -> frozenset[str]:
        """Generation: the best answer and the correct ones; MC: the choices and their labels (for ``requires()``
        checks)."""
        fields = {"target", "meta.question", "meta.mode", "meta.type", "meta.category", "meta.source"}
        if self.mode == "generation":
            return frozenset(fields | {"meta.best_answer", "meta.correct_answers", "meta.incorrect_answers",
                                       "meta.answers"})
        return frozenset(fields | {"choices", "label", "meta.labels"})


def build_truthfulqa(config: TruthfulQA, ctx: TaskContext) -> list[Example]:
    """MC examples (choices, label, meta labels) or generation examples (target: the best answer)."""
    out = []
    for row in config.rows(ctx):
        question = str(_field(row, "truthfulqa", "question", "Question")).strip()
        default = (QA_PRIMER + "\n\n" if config.primer else "") + f"Q: {question}\nA:"
        prompt = config.prompt(default, {"question": question, "primer": QA_PRIMER}, row)
        meta: dict[str, Any] = {"question": question, "mode": config.mode}
        for key, names in (("type", ("type", "Type")), ("category", ("category", "Category")),
                           ("source", ("source", "Source"))):
            value = _field(row, "truthfulqa", *names, required=False)
            if value is not None:
                meta[key] = str(value)
        mc_format = "mc1_targets" in row.data or "mc2_targets" in row.data
        if mc_format:
            if config.mode == "generation":
                raise TaskDataError(f"truthfulqa task: {row.where()}: mode generation needs the "
                                    "TruthfulQA.csv format (Best Answer, Correct Answers, ...), not mc_task.json")
            key = f"{config.mode}_targets"
            pairs = _mc_targets(_field(row, "truthfulqa", key), key, row)
            if config.mode == "mc1" and sum(lab for _, lab in pairs) != 1:
                raise TaskDataError(f"truthfulqa task: {row.where()}: mc1_targets needs exactly one true answer")
        else:
            best = _close(str(_field(row, "truthfulqa", "Best Answer", "best_answer")), config.close)
            correct = _multi(_field(row, "truthfulqa", "Correct Answers", "correct_answers"), config.close,
                             "Correct Answers", row)
            incorrect = _multi(_field(row, "truthfulqa", "Incorrect Answers", "incorrect_answers"),
                               config.close, "Incorrect Answers", row)
            if config.mode == "generation":
                meta.update(best_answer=best, correct_answers=correct, incorrect_answers=incorrect,
                            answers=correct)
                out.append(Example(prompt=prompt, target=" " + best, meta=meta))
                continue
            if config.mode == "mc1":
                pairs = [(best, 1)] + [(a, 0) for a in incorrect]
            else:
                pairs = [(a, 1) for a in correct] + [(a, 0) for a in incorrect]
        if not any(lab for _, lab in pairs):
            raise TaskDataError(f"truthfulqa task: {row.where()}: no true answer among the choices")
        labels = [lab for _, lab in pairs]
        choices = [" " + a for a, _ in pairs]
        label = labels.index(1)
        meta["labels"] = labels
        out.append(Example(prompt=prompt, target=choices[label], choices=choices, label=label, meta=meta))
    return out


# --- NQ-Open --------------------------------------------------------------------------------------

def _question_mark(q: str) -> str:
    q = q.strip()
    return q if q.endswith("?") else q + "?"


class NqOpen(_Benchmark):
    """NQ-Open: closed-book questions with a list of acceptable answers."""

    kind: Literal["nq_open"] = "nq_open"

    def example_fields(self) -> frozenset[str]:
        """The first answer as the target, every answer in meta (for ``requires()`` checks)."""
        return frozenset({"target", "meta.answer", "meta.answers", "meta.question"})


def build_nq_open(config: NqOpen, ctx: TaskContext) -> list[Example]:
    """``Q: <question>?\\nA:`` -> `` <first answer>``; every answer in ``meta["answers"]``."""
    out = []
    for row in config.rows(ctx):
        question = str(_field(row, "nq_open", "question")).strip()
        answers = _answers(_field(row, "nq_open", "answer", "answers"), "answer", row, "nq_open")
        prompt = config.prompt(f"Q: {_question_mark(question)}\nA:",
                               {"question": question, "answers": answers, "answer": answers[0]}, row)
        out.append(Example(prompt=prompt, target=" " + answers[0],
                           meta={"answer": answers[0], "answers": answers, "question": question}))
    return out


# --- NQ-Swap --------------------------------------------------------------------------------------

class NqSwap(_Benchmark):
    """NQ-Swap: NQ questions with the answer entity substituted in the context (context vs memory)."""

    kind: Literal["nq_swap"] = "nq_swap"
    context: Literal["substituted", "original"] = Field(
        "substituted", description="use the entity-substituted context (sub_context) or the original")

    def example_fields(self) -> frozenset[str]:
        """The context's and the memorised answers, the context span (for ``requires()`` checks)."""
        return frozenset({"target", "spans", "meta.context_answer", "meta.memory_answer", "meta.context_answers",
                          "meta.memory_answers", "meta.answers", "meta.question", "meta.substituted"})


def build_nq_swap(config: NqSwap, ctx: TaskContext) -> list[Example]:
    """Context + question; target the context's answer; memory answer (original) in meta."""
    out = []
    for row in config.rows(ctx):
        question = str(_field(row, "nq_swap", "question")).strip()
        org = _answers(_field(row, "nq_swap", "org_answer"), "org_answer", row, "nq_swap")
        if config.context == "substituted":
            context = str(_field(row, "nq_swap", "sub_context")).strip()
            answers = _answers(_field(row, "nq_swap", "sub_answer"), "sub_answer", row, "nq_swap")
        else:
            context = str(_field(row, "nq_swap", "org_context")).strip()
            answers = org
        default = f"Context: {context}\nQuestion: {_question_mark(question)}\nAnswer:"
        prompt = config.prompt(default, {"context": context, "question": question}, row)
        out.append(Example(
            prompt=prompt, target=" " + answers[0], spans=_named_span("context", prompt, context),
            meta={"context_answer": answers[0], "memory_answer": org[0], "context_answers": answers,
                  "memory_answers": org, "answers": answers, "question": question,
                  "substituted": config.context == "substituted"}))
    return out


# --- MemoTrap -------------------------------------------------------------------------------------

class MemoTrap(_Benchmark):
    """MemoTrap: instructions that contradict a memorised continuation (two-way multiple choice)."""

    kind: Literal["memotrap"] = "memotrap"

    def example_fields(self) -> frozenset[str]:
        """The choices, the instructed ending and (two classes) the memorised one (for ``requires()`` checks)."""
        return frozenset({"target", "choices", "label", "meta.labels", "meta.context_answer", "meta.memory_answer"})


def build_memotrap(config: MemoTrap, ctx: TaskContext) -> list[Example]:
    """The prompt as given; choices = classes (they already start with a space); label = answer_index."""
    out = []
    for row in config.rows(ctx):
        text = str(_field(row, "memotrap", "prompt"))
        classes = [str(c) for c in parse_list(_field(row, "memotrap", "classes"), "classes", row, "memotrap")]
        raw = _field(row, "memotrap", "answer_index")
        try:
            label = int(str(raw).strip())
        except ValueError:
            label = -1
        if not 0 <= label < len(classes):
            raise TaskDataError(f"memotrap task: {row.where()}: answer_index {raw!r} is not an index of "
                                f"classes (0..{len(classes) - 1})")
        prompt = config.prompt(text, {"prompt": text, "classes": classes}, row)
        meta: dict[str, Any] = {"labels": [int(i == label) for i in range(len(classes))],
                                "context_answer": classes[label].strip()}
        if len(classes) == 2:
            meta["memory_answer"] = classes[1 - label].strip()
        out.append(Example(prompt=prompt, target=classes[label], choices=classes, label=label, meta=meta))
    return out


# --- XSum -----------------------------------------------------------------------------------------

class XSum(_Benchmark):
    """XSum: one-sentence summaries of BBC articles (ROUGE-L, faithfulness)."""

    kind: Literal["xsum"] = "xsum"

    def example_fields(self) -> frozenset[str]:
        """The reference summary, the document's span and its id (for ``requires()`` checks)."""
        return frozenset({"target", "spans", "meta.id"})


def build_xsum(config: XSum, ctx: TaskContext) -> list[Example]:
    """``Article: <document>\\nSummarize the article in one sentence.\\nSummary:`` -> `` <summary>``."""
    out = []
    for row in config.rows(ctx):
        document = str(_field(row, "xsum", "document")).strip()
        summary = str(_field(row, "xsum", "summary")).strip()
        default = f"Article: {document}\nSummarize the article in one sentence.\nSummary:"
        prompt = config.prompt(default, {"document": document}, row)
        meta: dict[str, Any] = {}
        ident = _field(row, "xsum", "id", required=False)
        if ident is not None:
            meta["id"] = str(ident)
        out.append(Example(prompt=prompt, target=" " + summary, spans=_named_span("document", prompt, document),
                           meta=meta))
    return out


@hookimpl
def headlab_register_tasks(register):
    register(TruthfulQA, build_truthfulqa)
    register(NqOpen, build_nq_open)
    register(NqSwap, build_nq_swap)
    register(MemoTrap, build_memotrap)
    register(XSum, build_xsum)
