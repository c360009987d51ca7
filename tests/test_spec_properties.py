"""Property tests of the spec loader, with specs generated from the JSON Schema (tests/spec_strategies.py).

- A spec valid for the JSON Schema is accepted, or refused only by a rule the schema cannot express
  (listed below), and it loads the same from data and from YAML text.
- A broken spec (data- or YAML-level mutations) is accepted or refused with a located ``SpecError``;
  never any other exception, and never slower than a few seconds. It is refused whenever it is surely
  invalid: not YAML, not a mapping, or with a top-level key the schema does not know or needs and misses.

A bounded number of examples runs here; tools/reliability/fuzz_specs.py runs tens of thousands.
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="property tests need hypothesis (pip install -e '.[dev]')")

import spec_strategies as S  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

import headlab  # noqa: E402
from headlab.spec import SpecError  # noqa: E402

from fixtures.timing import within  # noqa: E402

SETTINGS = settings(max_examples=30, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SECONDS = 10

# Rules of built-in plugins that the JSON Schema cannot express (value ranges checked in Python,
# checks against the installed plugins): a schema-valid spec may be refused for these, and only these.
CROSS_FIELD = (
    "num_pairs must be between", "context_lengths must be positive", "value_len: 1 <= lo <= hi",
    "hi must be >= lo", "needles:", "k: a list of positive head counts", "no metrics plugin provides kind",
    "a depth count must be", "depths are fractions", "missing `kind`", "with lo <= hi",
    "distinct colour x shape objects", "yes questions need", "no questions need", "questions are about different shapes",
    "`image_dir` needs `image`", "IOI template", "names: give at least two different names",
    "shape a random draw: add `random: true`",
    # model placement (device_map, max_memory, offload_folder)
    "device_map is empty", "give a GPU index", "needs device_map", "or device_map, not both",
    "puts modules on 'disk'", "max_memory[",
    # KV policies and circuit detectors
    "an odd width is needed", "`threshold` cuts a head selection", "give exactly one of `like`",
    "refer to `like`: give `like`", "selects no count of heads", "ranks heads for a `budget`",
    "a `budget` ranks KV heads", "give exactly one of `fraction`", "circuit: give exactly one of top",
    "length must be at least 2", "words: each must be one word",
    "prefill: full attends every head over the whole prompt",
    "the question is fed after a full prefill's", "kv question_tokens splits a prompt",
)


def outcome(value) -> str:
    """'ok', or the SpecError's message; asserts the error is located and nothing else escapes."""
    with within(SECONDS, "loading"):
        try:
            headlab.load_spec(value)
        except SpecError as e:
            assert e.path or e.line is not None, f"unlocated: {e}"
            assert "\n" not in str(e)
            return e.message
    return "ok"


@SETTINGS
@given(S.schema_specs())
def test_schema_valid_specs_are_accepted(spec):
    result = outcome(spec)
    assert result == "ok" or any(rule in result for rule in CROSS_FIELD), result
    assert outcome(S.to_yaml(spec)) == result  # the same from YAML text


def surely_invalid(level: str, value) -> str:
    """Why no loader may accept this case, or "" when it may be valid: YAML text that a YAML parser
    cannot read, a spec that is not a mapping, or a top-level key that the schema does not know or needs
    and misses."""
    from ruamel.yaml import YAML

    if level == "yaml":
        try:
            value = YAML(typ="safe", pure=True).load(value)
        except Exception as e:  # every parser error, RecursionError included
            return f"not YAML ({type(e).__name__})"
    if not isinstance(value, dict):
        return f"not a mapping ({type(value).__name__})"
    schema = S.spec_schema()
    unknown = sorted(map(repr, set(value) - set(schema["properties"])))
    missing = sorted(set(schema["required"]) - set(value))
    if unknown or missing:
        return f"unknown top-level keys {unknown}, missing {missing}"
    return ""


def check_broken(case) -> None:
    level, value = case
    result = outcome(value)
    reason = surely_invalid(level, value)
    assert not (reason and result == "ok"), f"accepted, but {reason}"


@settings(SETTINGS, max_examples=45)
@given(S.mutated_specs())
def test_broken_specs_are_located_spec_errors_and_nothing_else(case):
    check_broken(case)


@pytest.mark.slow  # more of the same draws (hypothesis derives them from the test's name, so these are others)
@settings(SETTINGS, max_examples=150)
@given(S.mutated_specs())
def test_more_broken_specs_are_located_spec_errors_and_nothing_else(case):
    check_broken(case)


def test_a_key_with_a_line_break_stays_on_the_error_s_one_line():
    """Found by the draws above: a key holding a line break (or an escape character) is shown escaped."""
    with pytest.raises(SpecError) as e:
        headlab.load_spec({"name": "x", "model": "headlab-tiny", "task": {"kind": "repeated_tokens"},
                           "steps": [{"id": "a", "detect": {"kind": "induction"}}], "bad\nkey\x1b": 1})
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)
    assert "unknown key 'bad\\nkey\\x1b'" in str(e.value), str(e.value)
