"""``jsonl`` and ``csv`` tasks: examples from local files through Jinja2 templates.

A row of the file is the template context::

    task:
      kind: jsonl
      path: data/questions.jsonl
      prompt: "Q: {{ question }}\\nA:"
      target: "{{ answer }}"

Templates are Jinja2 with ``StrictUndefined`` in a sandboxed, immutable environment (a spec never
runs code) with limits: one render makes at most :data:`MAX_TEMPLATE_STEPS` loop iterations and
calls, no string or list longer than :data:`MAX_TEMPLATE_CHARS` and no output longer than that,
and ``{% include %}``, ``{% import %}``, ``{% extends %}`` and recursive loops are refused (a template
renders one record; it loads nothing). Mistakes are caught early and named:

- a template written with single braces (``"Q: {question}"``, the Python/lm-eval habit) is refused
  when the spec is validated, with the fix (``{{ question }}``);
- a row that lacks a variable a template uses is an error naming the file, the row (and line) and
  the variable;
- a missing file, invalid JSON or UTF-8, a CSV field over the csv module's size limit, a label that
  is not a choice, span offsets outside the prompt: one clear error each, naming the file and line;
- a file over :data:`MAX_DATA_FILE_BYTES` (checked with ``os.stat`` before it is read, and before the run's
  store is created), a row over :data:`MAX_ROW_CHARS`, a value or a list cell nested deeper than
  :data:`MAX_DATA_DEPTH`, an image over :data:`MAX_IMAGE_PIXELS` (a decompression bomb: read from the image
  file's header): one error each, naming the file, the row and the limit.

``target`` and every choice are *continuations* of the prompt: ``target_delimiter`` (default
``" "``, as in lm-eval) is put in front of each, so ``prompt + target`` is the full text.

Images: ``image: <field>`` names the field holding an example's image, a local file path (or a list
of them, or a cell holding a JSON list); a relative path is relative to ``image_dir`` when given,
else to the data file's directory (the working directory for ``hf_dataset``, whose image field may
also hold decoded ``PIL`` images). The prompt marks where each image goes with ``<image>``
(:data:`headlab.context.IMAGE_MARKER`), one marker per image; a prompt without any marker gets
``"<image>\n"`` (one per image) in front, and span offsets from ``spans`` fields stay offsets into
the template's own rendering (they are shifted past the added markers). A missing image file is an
error naming the row and the path it looked at. URLs are refused: images are local files.

This module also holds the helpers the benchmark loaders share (file reading, ``datasets`` loading,
templates, inline span tags).
"""

from __future__ import annotations

import ast
import csv
import io
import json
import random
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jinja2 import UndefinedError
from jinja2 import meta as jinja_meta
from jinja2.exceptions import SecurityError
from PIL import Image
from pydantic import Field, field_validator, model_validator

from headlab import IMAGE_MARKER
from headlab import strip_tags as core_strip_tags
from headlab.plugin import ComponentConfig, Example, PositiveInt, Seed, TaskContext, hookimpl
from headlab.resources import format_bytes
from headlab.sandbox import ENV, TemplateLimitError, is_jinja, lint_template, single_brace_names

__all__ = [
    "TaskDataError", "TemplateLimitError", "Row", "Template", "lint_template", "strip_tags", "read_rows", "load_hf",
    "resolve_path", "resolve_image", "parse_list", "resolve_label", "select_rows", "DataSource", "JsonlTask",
    "CsvTask", "build_file_task", "MAX_WORD_CHARS", "long_word", "word_error", "MAX_DATA_FILE_BYTES", "MAX_ROW_CHARS",
    "MAX_DATA_DEPTH", "MAX_IMAGE_PIXELS", "check_data_file", "check_image", "nested_deeper",
]

MAX_DATA_FILE_BYTES = 2**30
"""Largest task data file (1 GiB), checked with ``os.stat`` before the file is read: a task reads its whole
file (also with ``n:``), and parsed rows take several times the file's size in memory."""
MAX_ROW_CHARS = 10_000_000
"""Longest row of a data file (a JSON Lines line, a CSV record), in characters: twice what a template may
render (:data:`headlab.sandbox.MAX_TEMPLATE_CHARS`)."""
MAX_DATA_DEPTH = 64
"""Deepest nesting of a row's values (a JSON row, a cell or field holding a list literal), as for specs
(:data:`headlab.spec.MAX_DEPTH`): deeper data overflows the parser's stack."""
MAX_IMAGE_PIXELS = 89_478_485
"""Most pixels (width x height) of an image a task names: Pillow's own warning threshold
(``PIL.Image.MAX_IMAGE_PIXELS``); a larger image is a decompression bomb or needs resizing anyway (a
processor resizes every image to a few hundred pixels a side)."""

MAX_WORD_CHARS = 100_000
"""The longest run of characters without whitespace a task's text may hold: a fast tokenizer's pre-tokenizer
works on one such run at a time, and one of megabytes can abort the process (a Rust stack overflow) or take
minutes."""
_WORD = re.compile(r"\S+")


def long_word(text: str, limit: int = MAX_WORD_CHARS) -> tuple[int, int] | None:
    """``(offset, length)`` of the first run of non-whitespace characters in ``text`` longer than ``limit``,
    or None."""
    if len(text) <= limit:
        return None
    for m in _WORD.finditer(text):
        if m.end() - m.start() > limit:
            return m.start(), m.end() - m.start()
    return None


def word_error(where: str, found: tuple[int, int], unit: str = "character") -> str:
    """The message for a text (``where``: its file, row or field) holding the over-long word ``found``
    (``(offset, length)``, the offset counted in ``unit``)."""
    offset, length = found
    return (f"{where} has a word of {length:,} characters without whitespace (from {unit} {offset + 1:,}), over "
            f"the {MAX_WORD_CHARS:,} a tokenizer is given at once (a longer one can abort the process); break it "
            "with spaces or newlines")


class TaskDataError(ValueError):
    """A task's data file, template or row is wrong; the message names where and how to fix it."""


@dataclass
class Row:
    """One record of a data file: its 1-based number, the file line it starts on, and its fields."""

    number: int
    data: dict[str, Any]
    source: str
    line: int | None = None

    def where(self) -> str:
        """``file row N (line L)``, for error messages."""
        line = f" (line {self.line})" if self.line is not None and self.line != self.number else ""
        return f"{self.source} row {self.number}{line}"


class Template:
    """A compiled, linted Jinja2 template with clear per-row errors."""

    def __init__(self, source: str, name: str, task: str) -> None:
        self.source, self.name, self.task = lint_template(source, name), name, task
        self.template = ENV.from_string(source)
        self.variables = sorted(jinja_meta.find_undeclared_variables(ENV.parse(source)))
        self._checked_singles = False

    def render(self, row: Row) -> str:
        """Render with the row's fields; a missing variable names the row and the variable."""
        fields = row.data
        if not self._checked_singles and is_jinja(self.source):
            # `{{ context }} Q: {question}`: single braces around a field of the data are a mistake too
            bad = [s for s in single_brace_names(self.source) if s.split(".")[0] in fields]
            if bad:
                raise TaskDataError(
                    f"{self.task} task: template `{self.name}` {self.source!r} has single-brace "
                    f"{{{bad[0]}}}, a field of the data; write {{{{ {bad[0]} }}}}")
            self._checked_singles = True
        for var in self.variables:
            if var not in fields:
                raise TaskDataError(
                    f"{self.task} task: {row.where()}: template `{self.name}` uses variable '{var}', "
                    f"which this row does not have (fields: {', '.join(map(str, fields)) or 'none'})")
            if fields[var] is None:
                raise TaskDataError(
                    f"{self.task} task: {row.where()}: template `{self.name}` uses variable '{var}', "
                    "which is null in this row")
        try:
            text = self.template.render(fields)
        except UndefinedError as e:
            raise TaskDataError(f"{self.task} task: {row.where()}: template `{self.name}`: {e.message}") from None
        except TemplateLimitError as e:
            raise TaskDataError(f"{self.task} task: {row.where()}: template `{self.name}` {e}") from None
        except SecurityError as e:
            raise TaskDataError(f"{self.task} task: template `{self.name}` is not allowed: {e}") from None
        except RecursionError:
            raise TaskDataError(f"{self.task} task: {row.where()}: template `{self.name}` recurses too "
                                "deeply") from None
        except Exception as e:  # anything else a template does wrong (1/0, a bad filter argument)
            raise TaskDataError(f"{self.task} task: {row.where()}: template `{self.name}` failed: "
                                f"{type(e).__name__}: {e}") from None
        found = long_word(text)
        if found is not None:
            raise TaskDataError(word_error(f"{self.task} task: {row.where()}: template `{self.name}` gives a text "
                                           "that", found))
        return text


# --- inline span tags -----------------------------------------------------------------------------

def strip_tags(text: str, tags: Mapping[str, str]) -> tuple[str, dict[str, list[tuple[int, int]]]]:
    """Remove ``<tag>...</tag>`` markers from ``text`` and return the plain text and the marked spans
    (:func:`headlab.strip_tags`); a malformed marker is a :class:`TaskDataError`."""
    try:
        return core_strip_tags(text, tags)
    except ValueError as e:
        raise TaskDataError(str(e)) from None


# --- reading data -----------------------------------------------------------------------------------

def resolve_path(path: str | Path, task: str) -> Path:
    """The file at ``path`` (relative to the working directory), or a clear error."""
    p = Path(path).expanduser()
    if not p.exists():
        raise TaskDataError(f"{task} task: file not found: {str(path)!r} (looked at {p.resolve()}; "
                            "relative paths are relative to the working directory)")
    if not p.is_file():
        raise TaskDataError(f"{task} task: {str(path)!r} is not a file")
    check_data_file(path, task)
    return p


def _file_too_big(path: str | Path, task: str, size: int, at_least: bool = False) -> TaskDataError:
    more = "over " if at_least else ""
    return TaskDataError(f"{task} task: data file {str(path)!r} is {more}{size:,} bytes ({format_bytes(size)}), over "
                         f"the limit of {MAX_DATA_FILE_BYTES:,} bytes ({format_bytes(MAX_DATA_FILE_BYTES)}) for a "
                         "task's data file (MAX_DATA_FILE_BYTES); put the rows you use into a smaller file (the "
                         "task reads the whole file, also with `n:`)")


def check_data_file(path: str | Path, task: str, key: str | None = None) -> None:
    """Refuse (:class:`TaskDataError`, naming the file, its size and the limit) a data file over
    :data:`MAX_DATA_FILE_BYTES`, from ``os.stat`` alone: nothing is read. A path that is not a file passes
    (reading it says what is wrong). ``key``: the config's key naming the file, given to the error as its
    ``path`` (a task config's ``preflight()`` is then located at that key in the spec)."""
    p = Path(path).expanduser()
    try:
        size = p.stat().st_size if p.is_file() else 0
    except OSError:
        return
    if size > MAX_DATA_FILE_BYTES:
        err = _file_too_big(path, task, size)
        err.path = (key,) if key else ()  # type: ignore[attr-defined]
        raise err


def check_image(image: Any, row: Row, task: str) -> None:
    """Refuse (:class:`TaskDataError`, naming the image, the row and both pixel counts) an image over
    :data:`MAX_IMAGE_PIXELS`: a ``PIL`` image by its size, a file by its header (Pillow reads no pixel data
    to open it); a file that is not an image is refused too."""
    name = getattr(image, "filename", "") or "the row's image"
    if hasattr(image, "size") and hasattr(image, "getbands"):
        width, height = image.size
        pixels: int | None = width * height
        shape = f"{width:,} x {height:,} = "
    else:

        name = str(image)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(image) as img:
                    width, height = img.size
            pixels, shape = width * height, f"{width:,} x {height:,} = "
        except Image.DecompressionBombError as e:  # over twice Pillow's limit: refused while reading the header
            found = re.search(r"\((\d+) pixels\)", str(e))
            pixels, shape = (int(found.group(1)) if found else None), ""
        except (OSError, ValueError) as e:
            raise TaskDataError(f"{task} task: {row.where()}: image {name!r} cannot be read as an image: "
                                f"{' '.join(str(e).split())[:200]}") from None
    if pixels is None or pixels > MAX_IMAGE_PIXELS:
        count = f"{shape}{pixels:,} pixels" if pixels is not None else "more pixels than Pillow allows"
        raise TaskDataError(f"{task} task: {row.where()}: image {name!r} has {count}, over the limit of "
                            f"{MAX_IMAGE_PIXELS:,} pixels (MAX_IMAGE_PIXELS; a decompression bomb?); resize it "
                            "(a model's processor shrinks it to a few hundred pixels a side anyway) or drop the row")


def resolve_image(value: Any, base: Path | None, row: Row, task: str, hint: str = "set `image_dir:`") -> Any:
    """An image of a row: a ``PIL.Image.Image`` as it is, or a path (relative to ``base``, else the working
    directory) to an existing local file; anything else is a clear error naming the row, the path it
    looked at and ``hint`` (the fix)."""
    if hasattr(value, "getbands") and hasattr(value, "size"):  # a decoded PIL image (datasets' Image feature)
        check_image(value, row, task)
        return value
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise TaskDataError(f"{task} task: {row.where()}: image must be a local file path, got {str(value)[:60]!r}")
    text = str(value).strip()
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", text):
        raise TaskDataError(f"{task} task: {row.where()}: image {text[:80]!r} is a URL; images must be local "
                            "files (download them and give their paths)")
    p = Path(text).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    if not p.is_file():
        raise TaskDataError(f"{task} task: {row.where()}: image not found: {str(p.resolve())!r}; {hint}")
    check_image(p, row, task)
    return p


def _read_text(p: Path, task: str) -> str:
    """A data file's text: UTF-8 (a byte-order mark is dropped); bad bytes name the file and line."""
    with p.open("rb") as fh:  # at most the limit: a file that grew since it was checked, or a special file
        data = fh.read(MAX_DATA_FILE_BYTES + 1)
    if len(data) > MAX_DATA_FILE_BYTES:
        raise _file_too_big(p, task, MAX_DATA_FILE_BYTES, at_least=True)
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise TaskDataError(f"{task} task: {p.name} line {line}: invalid UTF-8 (byte 0x{data[e.start]:02x} at "
                            f"column {col}); save the file as UTF-8") from None


_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[\[\]{}()]', re.DOTALL)


def nested_deeper(text: str, limit: int = MAX_DATA_DEPTH) -> bool:
    """Whether the brackets of ``text`` (a JSON or Python literal) nest deeper than ``limit``, outside quoted
    strings; the scan stops once past ``limit`` (a hostile ``[[[[...`` costs ``limit`` steps)."""
    if text.count("[") + text.count("{") + text.count("(") <= limit:
        return False
    depth = 0
    for m in _NESTING.finditer(text):
        c = m.group()
        if c in "[{(":
            depth += 1
            if depth > limit:
                return True
        elif c in "]})":
            depth = max(0, depth - 1)
    return False


def _too_deep(value: Any, limit: int = MAX_DATA_DEPTH) -> bool:
    """Whether ``value`` (a parsed row, itself level 1) nests lists and mappings deeper than ``limit``."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _deep_error(task: str, where: str, what: str = "a value") -> TaskDataError:
    return TaskDataError(f"{task} task: {where}: {what} is nested more than {MAX_DATA_DEPTH} levels deep, over the "
                         "limit for data (MAX_DATA_DEPTH); flatten it or drop the row")


def _long_row(task: str, where: str, chars: int) -> TaskDataError:
    return TaskDataError(f"{task} task: {where}: the row is {chars:,} characters long, over the limit of "
                         f"{MAX_ROW_CHARS:,} for one row (MAX_ROW_CHARS); shorten it or drop the row")


def _read_jsonl(text: str, name: str, task: str) -> list[Row]:
    rows = []
    for line_no, line in enumerate(io.StringIO(text, newline=None), 1):
        if not line.strip():
            continue
        where = Row(len(rows) + 1, {}, name, line_no).where()
        if len(line) > MAX_ROW_CHARS:
            raise _long_row(task, where, len(line.rstrip("\n")))
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{task} task: {name} line {line_no}: invalid JSON: {e.msg}") from None
        except RecursionError:
            raise _deep_error(task, where) from None
        if not isinstance(data, dict):
            raise TaskDataError(f"{task} task: {name} line {line_no}: expected a JSON object, "
                                f"got {type(data).__name__}")
        if line.count("[") + line.count("{") > MAX_DATA_DEPTH and _too_deep(data):
            raise _deep_error(task, where)
        rows.append(Row(len(rows) + 1, data, name, line_no))
    return rows


def _read_json(text: str, name: str, task: str) -> list[Row]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskDataError(f"{task} task: {name} line {e.lineno}: invalid JSON: {e.msg}") from None
    except RecursionError:
        raise _deep_error(task, name) from None
    if isinstance(data, dict):  # {"data": [...]} and similar single-key wrappers
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:
            data = lists[0]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise TaskDataError(f"{task} task: {name}: expected a JSON array of objects")
    rows = [Row(i + 1, r, name) for i, r in enumerate(data)]
    for row in rows:
        if _too_deep(row.data):
            raise _deep_error(task, row.where())
    return rows


def _read_csv(text: str, name: str, task: str, delimiter: str) -> list[Row]:
    rows = []
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    line = 1
    try:
        if reader.fieldnames is None:
            raise TaskDataError(f"{task} task: {name} is empty (a CSV file needs a header row)")
        line = reader.line_num + 1
        for rec in reader:
            if None in rec:
                raise TaskDataError(f"{task} task: {name} line {line}: more cells than header columns")
            row = Row(len(rows) + 1, {k: v for k, v in rec.items()}, name, line)
            chars = sum(len(v) for v in rec.values() if isinstance(v, str))
            if chars > MAX_ROW_CHARS:
                raise _long_row(task, row.where(), chars)
            rows.append(row)
            line = reader.line_num + 1
    except csv.Error as e:
        detail = (f"a field is longer than the csv module's limit of {csv.field_size_limit():,} characters"
                  if "field larger than field limit" in str(e) else f"invalid CSV: {e}")
        raise TaskDataError(f"{task} task: {name} line {line}: {detail}") from None
    return rows


def read_rows(path: str | Path, task: str, *, fmt: str | None = None, delimiter: str = ",") -> list[Row]:
    """Rows of a JSON Lines, JSON array or CSV/TSV file (``fmt``, else by extension; JSON Lines default)."""
    p = resolve_path(path, task)
    if fmt is None:
        suffix = p.suffix.lower()
        fmt = {".csv": "csv", ".tsv": "csv", ".json": "json"}.get(suffix, "jsonl")
        if suffix == ".tsv" and delimiter == ",":
            delimiter = "\t"
    text = _read_text(p, task)
    if fmt == "csv":
        return _read_csv(text, p.name, task, delimiter)
    if fmt == "json" or (fmt == "jsonl" and text.lstrip().startswith("[")):
        return _read_json(text, p.name, task)
    return _read_jsonl(text, p.name, task)


def load_hf(task: str, name: str, config: str | None, split: str) -> list[Row]:
    """Rows of a Hugging Face dataset through the ``datasets`` library (imported only here)."""
    try:
        import datasets  # noqa: PLC0415 - optional dependency, imported lazily
    except ImportError:
        raise TaskDataError(f"{task} task: hf_dataset needs the `datasets` package (pip install datasets); "
                            "or download the file once and give `path:`") from None
    ds = datasets.load_dataset(name, config, split=split)
    return [Row(i + 1, dict(r), f"{name}[{split}]") for i, r in enumerate(ds)]


def select_rows(rows: list[Row], n: int | None, shuffle: bool, seed: int) -> list[Row]:
    """The first ``n`` rows, after a seeded shuffle when asked."""
    if shuffle:
        rows = list(rows)
        random.Random(seed).shuffle(rows)
    return rows[:n] if n is not None else rows


# --- field values -----------------------------------------------------------------------------------

def parse_list(value: Any, what: str, row: Row, task: str) -> list[Any]:
    """A list field: a JSON list, or (CSV cells) a string holding a JSON or Python list literal."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and nested_deeper(text):
            raise _deep_error(task, row.where(), what)
        if text.startswith("["):
            for parse in (json.loads, ast.literal_eval):
                try:
                    parsed = parse(text)
                except (ValueError, SyntaxError, RecursionError, MemoryError):
                    continue
                if isinstance(parsed, list):
                    return parsed
    raise TaskDataError(f"{task} task: {row.where()}: {what} must be a list (or a cell holding a JSON "
                        f"list such as [\"a\", \"b\"]), got {str(value)[:60]!r}")


def resolve_label(value: Any, choices: Sequence[str], row: Row, task: str, delimiter: str = "") -> int:
    """The index of the correct choice: an index (int or digits), the text of a choice, or a letter."""
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        text = value.strip()
        stripped = [c[len(delimiter):] if delimiter and c.startswith(delimiter) else c for c in choices]
        for cand in (text, value):
            if cand in stripped:
                return stripped.index(cand)
        if re.fullmatch(r"-?\d+", text):
            value = int(text)
        elif re.fullmatch(r"[A-Z]", text):
            value = ord(text) - ord("A")
    if isinstance(value, int) and 0 <= value < len(choices):
        return value
    raise TaskDataError(f"{task} task: {row.where()}: label {value!r} is not a choice index "
                        f"0..{len(choices) - 1}, a choice's text or a letter A..{chr(ord('A') + len(choices) - 1)}")


def parse_spans(value: Any, name: str, prompt: str, row: Row, task: str) -> list[tuple[int, int]]:
    """``[start, end]`` or a list of them (JSON, or a cell holding JSON), checked against the prompt."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    pairs: Any = value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        pairs = [value]
    ok = isinstance(pairs, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) for v in p) for p in pairs)
    if not ok:
        raise TaskDataError(f"{task} task: {row.where()}: span '{name}' must be [start, end] or a list of "
                            f"them (character offsets into the prompt), got {value!r}")
    out = []
    for s, e in pairs:
        if not 0 <= s <= e <= len(prompt):
            raise TaskDataError(f"{task} task: {row.where()}: span '{name}' [{s}, {e}) is outside the "
                                f"prompt (length {len(prompt)})")
        out.append((int(s), int(e)))
    return out


# --- the jsonl and csv tasks ---------------------------------------------------------------------

class DataSource(ComponentConfig):
    """Fields shared by tasks that read records: a local file or a Hugging Face dataset."""

    kind: str
    path: str | None = Field(None, description="local data file (relative to the working directory)")
    hf_dataset: str | None = Field(None, description="load through the `datasets` library instead "
                                   "(only when it is installed); e.g. 'truthfulqa/truthful_qa'")
    hf_config: str | None = Field(None, description="dataset configuration name for hf_dataset")
    split: str = Field("validation", description="split for hf_dataset")
    n: PositiveInt | None = Field(None, description="use only the first n records (all when unset)")
    shuffle: bool = Field(False, description="shuffle the records (seeded) before taking n")
    seed: Seed = Field(0, description="offset added to the run seed for shuffling")

    @model_validator(mode="after")
    def _one_source(self) -> DataSource:
        if (self.path is None) == (self.hf_dataset is None):
            raise ValueError(f"{self.kind}: give exactly one of `path` (a local file) or `hf_dataset`")
        return self

    def preflight(self) -> None:
        """Before a run's store is created (and in ``headlab validate``): a data file over
        :data:`MAX_DATA_FILE_BYTES` is refused from its size alone, located at ``path``."""
        if self.path is not None:
            check_data_file(self.path, self.kind, key="path")

    def rows(self, ctx: TaskContext, *, fmt: str | None = None, delimiter: str = ",") -> list[Row]:
        """The selected records."""
        if self.path is not None:
            rows = read_rows(self.path, self.kind, fmt=fmt, delimiter=delimiter)
        else:
            rows = load_hf(self.kind, self.hf_dataset or "", self.hf_config, self.split)
        if not rows:
            raise TaskDataError(f"{self.kind} task: {self.path or self.hf_dataset} holds no records")
        return select_rows(rows, self.n, self.shuffle, ctx.seed + self.seed)


class _FileTask(DataSource):
    prompt: str = Field(description="Jinja2 template of the prompt, e.g. 'Q: {{ question }}\\nA:'")
    target: str | None = Field(None, description="Jinja2 template of the expected continuation")
    choices: str | list[str] | None = Field(
        None, description="multiple choice: a field holding a list, a template rendering a list "
        "literal, or a list of templates (one per choice)")
    label: str | None = Field(None, description="field holding the correct choice (index, text or letter)")
    target_delimiter: str = Field(" ", description="put in front of the target and each choice")
    spans: dict[str, str] = Field(default_factory=dict, description="span name -> field holding "
                                  "[start, end] character offsets (or a list of them) into the prompt")
    span_tags: dict[str, str] = Field(default_factory=dict, description="span name -> tag: "
                                      "<tag>...</tag> in the rendered prompt is removed and recorded as "
                                      "that span, e.g. {emphasis: em}")
    meta: list[str] = Field(default_factory=list, description="fields copied into each example's meta")
    image: str | None = Field(None, description="field holding the example's image: a local file path (or a "
                              "list of them); the prompt marks it with <image> (added in front when missing)")
    image_dir: str | None = Field(None, description="folder that relative image paths are relative to "
                                  "(default: the data file's folder)")

    @field_validator("prompt", "target")
    @classmethod
    def _lint(cls, v: str | None, info: Any) -> str | None:
        return v if v is None else lint_template(v, info.field_name)

    @field_validator("choices")
    @classmethod
    def _lint_choices(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            for i, t in enumerate(v):
                lint_template(t, f"choices[{i}]")
        elif isinstance(v, str) and ("{" in v or "}" in v):
            lint_template(v, "choices")
        return v

    @model_validator(mode="after")
    def _label_needs_choices(self) -> _FileTask:
        if self.label is not None and self.choices is None:
            raise ValueError("`label` needs `choices`")
        if self.image_dir is not None and self.image is None:
            raise ValueError("`image_dir` needs `image` (the field holding the image path)")
        return self

    def example_fields(self) -> frozenset[str]:
        """What the templates and options give each example: the target, choices, label, spans, images, the data
        row and the fields copied into meta (for ``requires()`` checks)."""
        fields = {"meta.row", *(f"meta.{name}" for name in self.meta)}
        if self.target is not None or (self.choices is not None and self.label is not None):
            fields.add("target")
        if self.choices is not None:
            fields.add("choices")
        if self.label is not None:
            fields.add("label")
        if self.spans or self.span_tags:
            fields.add("spans")
        if self.image is not None:
            fields.add("images")
        return frozenset(fields)

    def image_base(self) -> Path | None:
        """The folder relative image paths are relative to (None: the working directory)."""
        if self.image_dir is not None:
            return Path(self.image_dir).expanduser()
        return Path(self.path).expanduser().parent if self.path is not None else None


class JsonlTask(_FileTask):
    """Examples from a JSON Lines file through Jinja2 templates."""

    kind: Literal["jsonl"] = "jsonl"


class CsvTask(_FileTask):
    """Examples from a CSV file (header row) through Jinja2 templates."""

    kind: Literal["csv"] = "csv"
    delimiter: str = Field(",", min_length=1, max_length=1, description="cell delimiter ('\\t' for TSV)")


def _choices(config: _FileTask, templates: dict[str, Template], row: Row) -> list[str] | None:
    spec = config.choices
    if spec is None:
        return None
    if isinstance(spec, list):
        values: list[Any] = [templates[f"choices[{i}]"].render(row) for i in range(len(spec))]
    elif "choices" in templates:
        rendered = templates["choices"].render(row)
        values = parse_list(rendered, "the rendered `choices` template", row, config.kind)
    else:
        if spec not in row.data:
            raise TaskDataError(f"{config.kind} task: {row.where()}: choices field '{spec}' is missing "
                                f"(fields: {', '.join(map(str, row.data))})")
        values = parse_list(row.data[spec], f"choices field '{spec}'", row, config.kind)
    if not values:
        raise TaskDataError(f"{config.kind} task: {row.where()}: no choices")
    return [config.target_delimiter + str(v) for v in values]


def build_file_task(config: _FileTask, ctx: TaskContext) -> list[Example]:
    """Render every selected row into an Example."""
    kind = config.kind
    templates = {"prompt": Template(config.prompt, "prompt", kind)}
    if config.target is not None:
        templates["target"] = Template(config.target, "target", kind)
    if isinstance(config.choices, list):
        for i, t in enumerate(config.choices):
            templates[f"choices[{i}]"] = Template(t, f"choices[{i}]", kind)
    elif isinstance(config.choices, str) and is_jinja(config.choices):
        templates["choices"] = Template(config.choices, "choices", kind)
    rows = config.rows(ctx, fmt="csv" if kind == "csv" else None, delimiter=getattr(config, "delimiter", ","))
    examples = []
    for row in rows:
        prompt, spans = strip_tags(templates["prompt"].render(row), config.span_tags)
        for name, field in config.spans.items():
            if field not in row.data:
                raise TaskDataError(f"{kind} task: {row.where()}: span field '{field}' is missing")
            spans.setdefault(name, []).extend(parse_spans(row.data[field], name, prompt, row, kind))
        images = _images(config, row, prompt)
        if images and IMAGE_MARKER not in prompt:
            shift = len(IMAGE_MARKER + "\n") * len(images)
            prompt = f"{IMAGE_MARKER}\n" * len(images) + prompt
            spans = {name: [(s + shift, e + shift) for s, e in pairs] for name, pairs in spans.items()}
        choices = _choices(config, templates, row)
        label = None
        if config.label is not None:
            if config.label not in row.data:
                raise TaskDataError(f"{kind} task: {row.where()}: label field '{config.label}' is missing")
            label = resolve_label(row.data[config.label], choices or [], row, kind, config.target_delimiter)
        if "target" in templates:
            target = config.target_delimiter + templates["target"].render(row)
        elif choices is not None and label is not None:
            target = choices[label]
        else:
            target = None
        meta: dict[str, Any] = {"row": row.number}
        for field in config.meta:
            if field not in row.data:
                raise TaskDataError(f"{kind} task: {row.where()}: meta field '{field}' is missing")
            meta[field] = row.data[field]
        examples.append(Example(prompt=prompt, target=target, choices=choices, label=label, spans=spans,
                                meta=meta, images=images))
    return examples


def _images(config: _FileTask, row: Row, prompt: str) -> list[Any]:
    """The row's images (empty without ``image:``), checked against the prompt's markers."""
    if config.image is None:
        return []
    kind = config.kind
    if config.image not in row.data:
        raise TaskDataError(f"{kind} task: {row.where()}: image field '{config.image}' is missing "
                            f"(fields: {', '.join(map(str, row.data))})")
    value = row.data[config.image]
    values = parse_list(value, f"image field '{config.image}'", row, kind) \
        if isinstance(value, (list, tuple)) or (isinstance(value, str) and value.strip().startswith("[")) else [value]
    if not values:
        raise TaskDataError(f"{kind} task: {row.where()}: image field '{config.image}' holds no image")
    markers = prompt.count(IMAGE_MARKER)
    if markers and markers != len(values):
        raise TaskDataError(f"{kind} task: {row.where()}: the prompt has {markers} {IMAGE_MARKER} markers for "
                            f"{len(values)} image(s); write one marker per image (or none: one is put in front)")
    hint = ("set `image_dir:` to the folder holding the images" if config.image_dir is None
            else f"check `image_dir: {config.image_dir}`")
    return [resolve_image(v, config.image_base(), row, kind, hint) for v in values]


@hookimpl
def headlab_register_tasks(register):
    register(JsonlTask, build_file_task)
    register(CsvTask, build_file_task)
