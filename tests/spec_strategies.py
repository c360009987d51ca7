"""Hypothesis strategies for headlab specs, generated from the spec JSON Schema.

``schema_specs()`` draws specs that satisfy the JSON Schema (every installed kind, every field within
its type, bounds and pattern), shaped by the few rules a JSON Schema cannot say (a step has exactly
one action, unique step ids, ``heads: {from: ...}`` names an earlier detect step).
``mutated_specs()`` breaks them: deleted, renamed and unknown keys, values of the wrong type or out
of range, hostile values (huge, deep, NaN, paths), bad sweeps, and YAML-level damage (tags, aliases,
duplicate keys, truncation, stray characters). Used by tests/test_spec_properties.py (a bounded
number of examples) and tools/reliability/fuzz_specs.py (tens of thousands).
"""

from __future__ import annotations

import io
import json
import math
import re
from functools import cache
from typing import Any

from hypothesis import strategies as st

# Plain text for strings in valid specs: no braces or '%', so template fields stay free of Jinja syntax.
SAFE_TEXT = st.text(alphabet=st.sampled_from("abcdefxyz ABC019_-.,:?!'"), max_size=12)


@cache
def spec_schema() -> dict[str, Any]:
    """The JSON Schema of specs with the built-in plugins (no third-party entry points)."""
    import headlab
    from headlab.plugin_manager import Manager

    return json.loads(json.dumps(headlab.json_schema(Manager(entry_points=False).registry)))


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    return node


def from_schema(node: dict[str, Any], defs: dict[str, Any] | None = None, name: str = "") -> st.SearchStrategy:
    """A strategy drawing values valid for one JSON Schema node (the subset pydantic emits)."""
    defs = spec_schema()["$defs"] if defs is None else defs
    node = _resolve(node, defs)
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    for key in ("oneOf", "anyOf"):
        if key in node:
            options = [from_schema(o, defs, name) for o in node[key] if _resolve(o, defs).get("type") != "null"]
            if len(options) < len(node[key]) and "default" in node:
                options.append(st.just(None))
            return st.one_of(options)
    kind = node.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**node, "type": k}, defs, name) for k in kind])
    if kind == "object":
        props = node.get("properties")
        if props is None and len(node.get("patternProperties") or {}) == 1:  # keys of a pattern (layer numbers)
            ((pattern, values),) = node["patternProperties"].items()
            keys = st.from_regex(pattern, fullmatch=True).filter(lambda s: len(s) <= 6)
            return st.dictionaries(keys, from_schema(values, defs, name), max_size=3)
        if props is None:
            extra = node.get("additionalProperties")
            values = from_schema(extra if isinstance(extra, dict) else {}, defs, name)
            return st.dictionaries(SAFE_TEXT.filter(bool), values, max_size=3)
        required = set(node.get("required", [])) | ({"kind"} & set(props))  # the discriminator
        return st.fixed_dictionaries(
            {k: from_schema(v, defs, k) for k, v in props.items() if k in required},
            optional={k: from_schema(v, defs, k) for k, v in props.items() if k not in required})
    if kind == "array":
        if "prefixItems" in node:
            return st.tuples(*(from_schema(i, defs, name) for i in node["prefixItems"])).map(list)
        low = node.get("minItems", 0)
        return st.lists(from_schema(node.get("items") or {}, defs, name), min_size=low,
                        max_size=min(node.get("maxItems", low + 3), low + 3))
    if kind == "string":
        if "pattern" in node:
            most = node.get("maxLength", 40)
            return st.from_regex(node["pattern"], fullmatch=True).filter(lambda s: len(s) <= most)
        return SAFE_TEXT.filter(lambda s: node.get("minLength", 0) <= len(s) <= node.get("maxLength", 10**9))
    if kind == "integer":
        low = node.get("minimum", node.get("exclusiveMinimum", -(10**6) - 1) + 1)
        high = node.get("maximum", node.get("exclusiveMaximum", 10**6 + 1) - 1)
        return st.integers(low, max(low, high))
    if kind == "number":
        return st.floats(node.get("minimum", node.get("exclusiveMinimum", -1e6)),
                         node.get("maximum", node.get("exclusiveMaximum", 1e6)),
                         exclude_min="exclusiveMinimum" in node, exclude_max="exclusiveMaximum" in node,
                         allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return st.one_of(st.integers(-5, 5), SAFE_TEXT, st.booleans())  # {}: any value


ACTIONS = ("detect", "generate", "score")


@st.composite
def schema_steps(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Steps as the schema allows, each with exactly one action and a unique id."""
    defs = spec_schema()["$defs"]
    step = defs["Step"]["properties"]
    steps = []
    for i in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(ACTIONS))
        entry = {"id": f"{draw(from_schema(step['id'], defs))[:56]}_{i}", action: draw(from_schema(step[action], defs))}
        if entry[action] is None:
            entry[action] = {"kind": "induction"} if action == "detect" else {"decode": {"kind": "greedy"}}
        if draw(st.booleans()) and draw(st.booleans()):
            entry["task"] = draw(from_schema(step["task"], defs))
            if entry["task"] is None:
                del entry["task"]
        steps.append(entry)
    return steps


def _fix_heads(node: Any, earlier: list[str], key: str = "") -> Any:
    """``heads: {from: ...}`` names an earlier detect step (or becomes an explicit list; per-head ``scores``,
    which a list of heads cannot give, a score file)."""
    if isinstance(node, dict):
        if "from" in node:
            if not earlier:
                return {"file": "heads.json"} if key == "scores" else [[0, 0]]
            node = {**node, "from": earlier[-1]}
            if node.get("top") is None and node.get("threshold") is None:
                node["top"] = 1
            return node
        return {k: _fix_heads(v, earlier, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_fix_heads(v, earlier, key) for v in node]
    return node


@cache
def _data_source_kinds() -> frozenset[str]:
    """Kinds whose config reads a local file or a Hugging Face dataset (exactly one of the two)."""
    defs = spec_schema()["$defs"]
    return frozenset(d["properties"]["kind"].get("const") for d in defs.values()
                     if {"path", "hf_dataset", "kind"} <= set(d.get("properties", {})))


def _one_of_each(node: Any) -> Any:
    """Cross-field rules of built-in configs: one model source, one data source, a label with choices."""
    if isinstance(node, dict):
        node = {k: _one_of_each(v) for k, v in node.items()}
        sources = [k for k in ("id", "path", "config") if node.get(k) is not None]
        if "kind" not in node and len(sources) > 1:  # a model spec: one source
            for extra in sources[1:]:
                del node[extra]
        if node.get("kind") in _data_source_kinds():
            if node.get("path") is not None and node.get("hf_dataset") is not None:
                del node["hf_dataset"]
            elif node.get("path") is None and node.get("hf_dataset") is None:
                node["path"] = "data.jsonl"
        if node.get("label") is not None and node.get("choices") is None:
            del node["label"]
        return node
    if isinstance(node, list):
        return [_one_of_each(v) for v in node]
    return node


@st.composite
def schema_specs(draw: st.DrawFn) -> dict[str, Any]:
    """A spec as data, valid for the JSON Schema (see the module docstring for what else is shaped)."""
    schema = spec_schema()
    props = schema["properties"]
    spec = draw(from_schema({**schema, "properties": {k: v for k, v in props.items()
                                                      if k not in ("steps", "sweep")}}))
    steps = draw(schema_steps())
    earlier: list[str] = []
    for step in steps:
        for key in [*ACTIONS, "task"]:
            if key in step:
                step[key] = _fix_heads(step[key], earlier)
        if "detect" in step:
            earlier.append(step["id"])
    spec["steps"] = steps
    execution = spec.get("execution")
    if isinstance(execution, dict) and "executor" not in execution:
        # the schema's executor union is told apart by `executor`; without it only the default's keys apply
        execution["executor"] = "local" if not execution else "ray"
    spec = _one_of_each(spec)
    if draw(st.booleans()):
        spec["sweep"] = {"seed": draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=4, unique=True))}
    return spec


# --- breaking specs ---------------------------------------------------------------------------------

HOSTILE = st.one_of(
    st.sampled_from([None, 0, -1, 1, 10**30, -(10**30), 2**63, 1e308, -0.0, "", " ", "../../x", "/abs/path",
                     "x" * 300, [], {}, [[]], {"kind": None}, {"kind": "nope"}, {"kind": []}, True, False,
                     [1, 1], ["a", "a"], "{{ x }}", "{x}", "{% include 'x' %}", "\x00", "\u202e", "~",
                     "NaN", ".inf", {"from": "nowhere", "top": 0}, [[0, 0], [99, 99]], {"0": [0]},
                     {"file": "/etc/passwd"}, {"from": "a"}, "cuda:99"]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.text(max_size=20),
    st.recursive(st.integers(0, 3), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                 max_leaves=10),
)


def paths_of(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys/indexes) inside a nested value, the root excluded."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append((*prefix, k))
            out += paths_of(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append((*prefix, i))
            out += paths_of(v, (*prefix, i))
    return out


def _parent(data: Any, path: tuple) -> Any:
    for part in path[:-1]:
        data = data[part]
    return data


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _dotted(spec: dict[str, Any], draw: st.DrawFn) -> str:
    """A sweep key, often a real one (a field inside a step or the task), sometimes nonsense."""
    options = ["seed", "task.n", "task.length", "model.dtype", "name", "output", "sweep", "steps.0.id",
               "steps", "nostep.x", "", ".", "task..n", "model"]
    for step in spec.get("steps", []) if isinstance(spec.get("steps"), list) else []:
        if isinstance(step, dict) and isinstance(step.get("id"), str):
            for action in ACTIONS:
                if isinstance(step.get(action), dict):
                    options.append(step["id"])
                    options += [f"{step['id']}.{k}" for k in step[action]]
    return draw(st.sampled_from(options))


@st.composite
def mutate_data(draw: st.DrawFn, spec: dict[str, Any]) -> dict[str, Any]:
    """Apply one to three random breakages to spec data."""
    data = json.loads(json.dumps(spec))
    for _ in range(draw(st.integers(1, 3))):
        paths = paths_of(data)
        how = draw(st.sampled_from(["delete", "replace", "replace", "unknown", "rename", "sweep", "deep",
                                    "wide", "top"]))
        if how == "top":
            key = draw(st.sampled_from(["name", "model", "task", "steps", "seed", "output", "description", "sweep"]))
            data[key] = draw(HOSTILE)
        elif how == "sweep":
            data["sweep"] = {_dotted(data, draw): draw(st.one_of(st.lists(HOSTILE, max_size=4), HOSTILE))}
        elif how == "deep":
            target = draw(st.sampled_from(paths)) if paths else ("model",)
            _parent(data, target)[target[-1]] = _nested(draw(st.integers(50, 400)))
        elif how == "wide":
            target = draw(st.sampled_from(paths)) if paths else ("model",)
            _parent(data, target)[target[-1]] = list(range(draw(st.integers(1000, 20000))))
        elif not paths:
            continue
        else:
            target = draw(st.sampled_from(paths))
            parent = _parent(data, target)
            if how == "delete":
                del parent[target[-1]]
            elif how == "replace":
                parent[target[-1]] = draw(HOSTILE)
            elif how == "unknown" and isinstance(parent, dict):
                parent[draw(st.text(min_size=1, max_size=8))] = draw(HOSTILE)
            elif how == "rename" and isinstance(parent, dict):
                parent[str(target[-1])[::-1] + "x"] = parent.pop(target[-1])
    return data


def to_yaml(data: Any) -> str:
    """Block-style YAML text of spec data (so errors have lines to point at)."""
    from ruamel.yaml import YAML

    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


YAML_DAMAGE = [
    "!!python/object/apply:os.system [ls]", "!!binary aGVsbG8=", "!!set {a, b}", "!!omap [a: 1]",
    "!!pairs [a: 1, b: 2]", "&anchor", "*undefined", "<<: *undefined", "? [a, b]\n: c", "? !!pairs [a: 1]\n: x",
    "\t", "{", "[", "}", "]", ":", "- ", "'", '"', "%YAML 1.1", "---", "...", "\x00", "\ufeff", "#",
    "!custom x", "!!int abc", "!!float [1]", "!!str", "!!null x", "!!timestamp 2020-01-01", "@", "`", "|",
    ">", "&a [1, 2]", "*a", "key: value\nkey: again", "<<: [*a, *a]",
]


@st.composite
def mutate_text(draw: st.DrawFn, text: str) -> str:
    """Break YAML text: insert damage at a random place, cut it, or add an alias bomb or a deep nest."""
    how = draw(st.sampled_from(["insert", "insert", "cut", "bomb", "deep", "anchors", "replace_line"]))
    if how == "cut":
        return text[: draw(st.integers(0, len(text)))]
    if how == "bomb":
        levels = draw(st.integers(2, 9))
        bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, levels))
        where = draw(st.sampled_from(["top", "config"]))
        if where == "config":
            return text.replace("model:\n", "model:\n  config:\n    model_type: llama\n    x:\n"
                                + "".join("      " + line + "\n" for line in bomb.splitlines()) + "  ", 1)
        return text + bomb
    if how == "deep":
        n = draw(st.integers(10, 3000))
        return text + "deep: " + "[" * n + "]" * n + "\n"
    if how == "anchors":
        lines = text.splitlines()
        i = draw(st.integers(0, max(len(lines) - 1, 0)))
        if lines and ":" in lines[i]:
            lines[i] = lines[i].replace(":", ": &x", 1) if not lines[i].rstrip().endswith(":") else lines[i]
        return "\n".join(lines) + "\nalias: *x\n"
    if how == "replace_line":
        lines = text.splitlines() or [""]
        i = draw(st.integers(0, len(lines) - 1))
        lines[i] = re.sub(r":.*", ": " + draw(st.sampled_from(YAML_DAMAGE)), lines[i], count=1)
        return "\n".join(lines) + "\n"
    pos = draw(st.integers(0, len(text)))
    return text[:pos] + draw(st.sampled_from(YAML_DAMAGE)) + text[pos:]


@st.composite
def mutated_specs(draw: st.DrawFn) -> tuple[str, Any]:
    """("data", spec dict) or ("yaml", text): a spec broken at the data or at the YAML level."""
    spec = draw(schema_specs())
    level = draw(st.sampled_from(["data", "yaml", "text"]))
    if level == "data":
        return "data", draw(mutate_data(spec))
    if level == "yaml":
        return "yaml", to_yaml(draw(mutate_data(spec)))
    return "yaml", draw(mutate_text(to_yaml(spec)))


def finite(value: Any) -> bool:
    """Whether a nested value holds no NaN or infinity (YAML cannot round-trip them as equal)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    if isinstance(value, list):
        return all(finite(v) for v in value)
    return True
