"""headlab.sandbox: the Jinja2 sandbox every template a spec supplies is rendered in.

A spec never runs code, and templates are code-shaped: headlab renders them in Jinja2's immutable sandbox
(no attribute starting with ``_``, no mutation of lists or dicts, no ``{% include %}``/``{% import %}``/
``{% extends %}``), with a budget per render: at most :data:`MAX_TEMPLATE_STEPS` loop iterations and calls,
no string or list longer than :data:`MAX_TEMPLATE_CHARS` (nor output longer than that), at most
:data:`MAX_TEMPLATE_WORK` characters built in all, integers of at most :data:`MAX_TEMPLATE_INT_BITS` bits and
:data:`MAX_TEMPLATE_SECONDS` seconds. :data:`ENV` is the environment the ``jsonl``/``csv`` tasks and the
benchmark loaders use; :func:`sandbox` makes another with extra filters (lm-eval's ``regex_replace``, for the
task templates of an ``evaluate`` step). :func:`lint_template` finds mistakes and refused constructs before
anything renders.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import string
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import regex
from jinja2 import StrictUndefined, TemplateSyntaxError, nodes
from jinja2 import Template as JinjaTemplate
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

__all__ = [
    "ENV", "MAX_TEMPLATE_CHARS", "MAX_TEMPLATE_INT_BITS", "MAX_TEMPLATE_SECONDS", "MAX_TEMPLATE_STEPS",
    "MAX_TEMPLATE_WORK", "LimitedSandbox", "TemplateLimitError", "check_template", "is_jinja", "lint_template",
    "regex_replace", "sandbox", "single_brace_names", "unsafe_names",
]

MAX_TEMPLATE_STEPS = 100_000
"""Most loop iterations plus calls (macros, methods, globals) in one render of a template."""
MAX_TEMPLATE_CHARS = 5_000_000
"""Longest output of one render, and longest string or list a template may build (characters, or items)."""
MAX_TEMPLATE_WORK = 50_000_000
"""Most characters (or items) a template's operations may build in one render, all together."""
MAX_TEMPLATE_INT_BITS = 4096
"""Largest integer (in bits) a template may compute."""
MAX_TEMPLATE_SECONDS = 30.0
"""Longest one render may take, in seconds (a safety net behind the limits above)."""


class TemplateLimitError(SecurityError):
    """A template went past one of the sandbox's limits (see the module's ``MAX_TEMPLATE_*``)."""


class _Budget:
    """What one render has spent: steps (loop iterations and calls) and work (characters built)."""

    def __init__(self) -> None:
        self.steps, self.work = 0, 0
        self.deadline = time.monotonic() + MAX_TEMPLATE_SECONDS


_BUDGET: ContextVar[_Budget | None] = ContextVar("headlab_template_budget", default=None)


def _spend(steps: int = 1, work: int = 0) -> None:
    budget = _BUDGET.get()
    if budget is None:
        budget = _Budget()
        _BUDGET.set(budget)
    budget.steps += steps
    budget.work += work
    if budget.steps > MAX_TEMPLATE_STEPS:
        raise TemplateLimitError(f"makes more than {MAX_TEMPLATE_STEPS:,} loop iterations and calls")
    if budget.work > MAX_TEMPLATE_WORK:
        raise TemplateLimitError(f"builds more than {MAX_TEMPLATE_WORK:,} characters in all")
    if time.monotonic() > budget.deadline:
        raise TemplateLimitError(f"takes longer than {MAX_TEMPLATE_SECONDS:g} s")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 0


def _refuse_size(n: float, what: str = "a value") -> None:
    if n > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"would build {what} of {int(n):,} characters or items (the limit is "
                                 f"{MAX_TEMPLATE_CHARS:,})")


def _bounded(value: Any) -> Any:
    """``value``, counted against the render's budget; refused when it is too large."""
    n = _size(value)
    _refuse_size(n)
    if isinstance(value, int) and value.bit_length() > MAX_TEMPLATE_INT_BITS:
        raise TemplateLimitError(f"computes an integer of more than {MAX_TEMPLATE_INT_BITS} bits")
    _spend(0, n)
    return value


def _loop_guard(iterable: Any) -> Iterator[Any]:
    """Every ``{% for %}`` iterates through this: each iteration is a step of the budget."""
    for item in iterable:
        _spend()
        yield item


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(fmt: Any, args: Any) -> None:
    if not isinstance(fmt, str):
        return
    values = args if isinstance(args, tuple) else (args,)
    for width, precision in _PRINTF.findall(fmt):
        for part in (width, precision):
            if part == "*":
                _refuse_size(max((abs(v) for v in values if isinstance(v, int)), default=0), "a field")
            elif part:
                _refuse_size(int(part), "a field")


def _check_format(fmt: str) -> None:
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec and "{" in spec:
            raise TemplateLimitError("uses a nested field in a format spec, which templates may not")
        for number in re.findall(r"\d+", spec or ""):
            _refuse_size(int(number), "a field")


def _check_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if _size(seq) and isinstance(n, int):
                _refuse_size(len(seq) * n)
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_TEMPLATE_INT_BITS:
                raise TemplateLimitError(f"computes an integer of more than {MAX_TEMPLATE_INT_BITS} bits")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if right * math.log2(abs(left)) > MAX_TEMPLATE_INT_BITS:
            raise TemplateLimitError(f"computes an integer of more than {MAX_TEMPLATE_INT_BITS} bits")
    elif op == "+" and _size(left) and _size(right):
        _refuse_size(len(left) + len(right))
    elif op == "%":
        _check_printf(left, right)


def _replaced_size(s: Any, old: Any, new: Any, count: Any = None) -> float:
    if not isinstance(s, (str, bytes)) or not isinstance(old, type(s)) or not isinstance(new, type(s)):
        return 0
    hits = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _check_method(obj: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Refuse a str/bytes/int method call that would build something too large; returns the arguments
    (an iterable given to ``join`` is made a list, to be measured)."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if isinstance(owner, (str, bytes)):
        if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
            _refuse_size(args[0])
        elif name == "expandtabs":
            tab = args[0] if args and isinstance(args[0], int) else 8
            _refuse_size(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * tab)
        elif name == "replace" and len(args) >= 2:
            _refuse_size(_replaced_size(owner, *args[:3]))
        elif name == "join" and args:
            items = list(_loop_guard(args[0]))
            _refuse_size(len(owner) * max(len(items) - 1, 0))
            args = (items, *args[1:])
        elif name == "translate" and args and isinstance(args[0], Mapping):
            longest = max((_size(v) for v in args[0].values()), default=1)
            _refuse_size(len(owner) * max(longest, 1))
    elif isinstance(owner, int) and name == "to_bytes" and args and isinstance(args[0], int):
        _refuse_size(args[0])
    return args


def _filter_check(name: str, arguments: dict[str, Any]) -> None:
    a = arguments
    if name == "center":
        _refuse_size(a.get("width", 0) if isinstance(a.get("width"), int) else 0)
    elif name == "indent":
        width = a.get("width", 4)
        size = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        text = a.get("s")
        lines = text.count("\n") + 1 if isinstance(text, str) else 1
        _refuse_size(lines * size + _size(text))
    elif name == "format":
        _check_printf(a.get("value"), tuple(a.get("args", ())))
    elif name == "replace":
        _refuse_size(_replaced_size(a.get("s"), a.get("old"), a.get("new"), a.get("count")))
    elif name == "join":
        items = list(_loop_guard(a.get("value", ())))
        a["value"] = items
        _refuse_size(_size(a.get("d")) * max(len(items) - 1, 0))
    elif name == "wordwrap":
        text, width, wrap = a.get("s"), a.get("width", 79), a.get("wrapstring") or "\n"
        if isinstance(text, str) and isinstance(width, int) and width > 0:
            _refuse_size(len(text) + (len(text) // width + 1) * _size(wrap))
    elif name in ("batch", "slice"):
        n = a.get("linecount" if name == "batch" else "slices")
        if isinstance(n, int) and n > MAX_TEMPLATE_STEPS:
            raise TemplateLimitError(f"{name} of {n:,} is more than {MAX_TEMPLATE_STEPS:,}")
    elif name == "tojson":
        indent = a.get("indent")
        if (_size(indent) if isinstance(indent, str) else indent or 0) > 1000:
            raise TemplateLimitError("tojson indent is larger than 1000")


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    try:
        signature: inspect.Signature | None = inspect.signature(func)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                bound = None
            if bound is not None:
                bound.apply_defaults()
                _filter_check(name, bound.arguments)
                args, kwargs = bound.args, bound.kwargs
        return _bounded(func(*args, **kwargs))

    return guarded


class _Guards(NodeTransformer):
    """Route every loop through :func:`_loop_guard` and measure every ``~`` concatenation."""

    def _call(self, name: str, arg: nodes.Expr, lineno: int) -> nodes.Call:
        return nodes.Call(nodes.ImportedName(f"{__name__}.{name}", lineno=lineno), [arg], [], None, None,
                          lineno=lineno)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._call("_loop_guard", node.iter, node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return self._call("_bounded", node, node.lineno)


class _LimitedTemplate(JinjaTemplate):
    """A template whose every render starts a fresh budget and whose output is bounded."""

    def render(self, *args: Any, **kwargs: Any) -> str:
        return "".join(self.generate(*args, **kwargs))

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[str]:
        _BUDGET.set(_Budget())
        total = 0
        for chunk in super().generate(*args, **kwargs):
            total += len(chunk)
            if total > MAX_TEMPLATE_CHARS:
                raise TemplateLimitError(f"renders more than {MAX_TEMPLATE_CHARS:,} characters")
            yield chunk


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox with a budget per render: loop iterations and calls, the size of every
    string, list and integer built, the output length and the time are bounded."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    template_class = _LimitedTemplate

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals.pop("lipsum", None)
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        tree = _Guards().visit(tree)
        tree.set_environment(self)
        return tree

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        """Reading an unsafe attribute is an error at once (Jinja2's sandbox returns an undefined value)."""
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _bounded(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _spend()
        args = _check_method(__obj, args)
        return _bounded(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__

        @functools.wraps(wrapper)
        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format(fmt)
            return _bounded(wrapper(*args, **kwargs))

        return checked


ENV = LimitedSandbox(undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False)

_REFUSED_TAGS = {nodes.Include: "include", nodes.Import: "import", nodes.FromImport: "from ... import",
                 nodes.Extends: "extends"}

# `{name}` not part of `{{ name }}`: the single-brace mistake.
_SINGLE = re.compile(r"(?<!\{)\{\s*([A-Za-z_][A-Za-z0-9_.]*)\s*\}(?!\})")


def single_brace_names(source: str) -> list[str]:
    """The names written as ``{name}`` (single braces, not part of ``{{ name }}``) in ``source``."""
    return _SINGLE.findall(source)


def is_jinja(source: str) -> bool:
    """Whether ``source`` uses any Jinja2 syntax (``{{ }}`` or ``{% %}``)."""
    return "{{" in source or "{%" in source


def unsafe_names(source: str) -> list[str]:
    """The attribute and item names starting with ``_`` that ``source`` reads (``x.__class__``,
    ``x['__globals__']``, ``x|attr('__init__')``): the sandbox refuses them when rendering; this finds them before anything renders."""
    found = []
    for node in ENV.parse(source).find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        if isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node, nodes.Getitem):
            name = getattr(node.arg, "value", None)
        else:  # x|attr('__class__')
            name = getattr(node.args[0], "value", None) if node.name == "attr" and node.args else None
        if isinstance(name, str) and name.startswith("_"):
            found.append(name)
    return list(dict.fromkeys(found))


def check_template(source: str, name: str) -> str:
    """Check a template for Jinja2 syntax errors and the constructs the sandbox refuses (``{% include %}``,
    ``{% import %}``, ``{% extends %}``, recursive loops, names starting with ``_``).

    Returns ``source`` unchanged; raises ``ValueError`` naming the template and what is wrong.
    """
    try:
        tree = ENV.parse(source)
    except TemplateSyntaxError as e:
        raise ValueError(f"template `{name}` {source!r}: Jinja2 syntax error: {e.message}") from None
    for node in tree.find_all(tuple(_REFUSED_TAGS)):
        raise ValueError(f"template `{name}` {source!r}: {{% {_REFUSED_TAGS[type(node)]} %}} is not allowed: a "
                         "template renders one record and loads no other template")
    for node in tree.find_all(nodes.For):
        if node.recursive:
            raise ValueError(f"template `{name}` {source!r}: recursive loops are not allowed")
    unsafe = unsafe_names(source)
    if unsafe:
        raise ValueError(f"template `{name}` {source!r} reads {', '.join(map(repr, unsafe))}: names starting with "
                         "'_' are not allowed in templates (the sandbox refuses them)")
    return source


def lint_template(source: str, name: str) -> str:
    """:func:`check_template`, and a template written with single braces and no Jinja syntax at all
    (``"Q: {question}"``, the Python habit) refused with the fix.

    Returns ``source`` unchanged; raises ``ValueError`` naming the template and the fix.
    """
    singles = _SINGLE.findall(source)
    if singles and not is_jinja(source):
        fixed = _SINGLE.sub(lambda m: "{{ " + m.group(1) + " }}", source)
        names = ", ".join("{" + s + "}" for s in dict.fromkeys(singles))
        raise ValueError(
            f"template `{name}` {source!r} uses single braces ({names}); templates are Jinja2, "
            f"write double braces: {fixed!r}")
    return check_template(source, name)


def regex_replace(value: str, pattern: str, repl: str, count: int = 0) -> str:
    """``re.sub(pattern, repl, value, count)`` as a filter, given up after :data:`MAX_TEMPLATE_SECONDS`
    (a pattern that backtracks catastrophically is an error, not a hang)."""
    try:
        return regex.sub(pattern, repl, value, count=count, timeout=MAX_TEMPLATE_SECONDS)
    except TimeoutError:
        raise TemplateLimitError(f"regex_replace {pattern!r} takes longer than {MAX_TEMPLATE_SECONDS:g} s") from None


def sandbox(filters: Mapping[str, Callable[..., Any]] | None = None, **options: Any) -> LimitedSandbox:
    """A new :class:`LimitedSandbox` (``StrictUndefined``, trailing newlines kept, no autoescaping, as
    :data:`ENV`) with extra ``filters``, each bounded like the built-in ones."""
    env = LimitedSandbox(**{"undefined": StrictUndefined, "keep_trailing_newline": True, "autoescape": False,
                            **options})
    for name, func in (filters or {}).items():
        env.filters[name] = _guard_filter(name, func)
    return env
