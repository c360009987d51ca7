"""Fuzz what a user types besides a spec file: ``--set`` overrides and lm-eval task mappings, counting escapes,
hangs and code runs.

Three sources, drawn from a seeded grammar of valid and hostile pieces:

- ``set``: one to three ``--set path=value`` items (real dotted paths and made-up ones; values that are YAML
  scalars, flow collections, tags, anchors and alias bombs, deep nests, huge numbers, NaN, control
  characters, oversized text) read by the command line's parser and applied to a valid spec, as ``headlab
  run SPEC --set ...`` does before anything runs;
- ``lm_eval``: an ``evaluate`` step with an inline task mapping whose templates and fields are drawn from
  honest templates, payloads that reach Python (attribute chains to ``__globals__``, names assembled at render
  time, ``attr``/``map`` filters, format strings, the Jinja globals ``cycler``, ``joiner``, ``namespace``,
  ``lipsum``, ``range``, ``self``) and fields that name code (``!function`` strings, metric scripts,
  ``hf_evaluate``, ``trust_remote_code``). The spec is validated; when it is accepted, every template of the
  task is rendered as lm-eval renders it at run time, inside headlab's sandbox (``sandboxed_templates``),
  with a document of the task's fields;
- ``spec``: specs of tests/spec_strategies.py (valid and mutated), as tools/reliability/fuzz_specs.py does.

Each payload would create a marker file when it runs; the marker is checked after every case. Outcomes:
accepted (and, for ``lm_eval``, rendered), refused with a located error (a ``SpecError`` with a line, a key
path or ``--set`` in its message; a template refused by the sandbox), an unlocated ``SpecError``, an escape
(any other exception), a hang (over ``--timeout`` seconds, interrupted by an alarm), a code run (the marker
exists).

    OMP_NUM_THREADS=1 python tools/reliability/fuzz.py --n 20000 --seed 0 --out fuzz.json

Not part of the test suite (tests/test_hostile_run.py runs a few hundred cases of it).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BASE = ("name: fuzz\nmodel: {config: {model_type: llama, hidden_size: 32, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 64, vocab_size: 97}}\n"
        "task: {kind: repeated_tokens, n: 4, length: 8}\n"
        "steps:\n  - id: ind\n    detect: {kind: induction}\n"
        "  - id: gen\n    generate: {max_new_tokens: 2, steer: [{kind: head_scale, heads: {from: ind, top: 2}, "
        "factor: 0.5}]}\n"
        "sweep: {seed: [0, 1]}\nlimits: {memory: 64GiB}\nexecution: {executor: local}\n")
SET_PATHS = ["task.n", "task.length", "task.kind", "task", "seed", "name", "output", "sweep", "limits",
             "limits.memory", "model", "model.device", "model.device_map", "model.config.hidden_size",
             "steps.0.detect.kind", "steps.1.generate.max_new_tokens", "steps.1.generate.steer.0.factor",
             "steps.1.generate.steer.0.heads.top", "steps.1.generate.decode", "steps.0.id", "steps", "execution",
             "gen.max_new_tokens", "ind.kind", "task.nn", "x.y.z", "steps.9.detect", "steps.-1", "", ".", "a..b",
             "task.n.deeper", "sweep.task.n", "__class__", "steps.1.generate.steer.0.__init__"]


class Hang(BaseException):
    """Raised by the alarm: a case took longer than the timeout."""


def _alarm(signum: int, frame: Any) -> None:
    raise Hang


def _bomb(levels: int) -> str:
    names = [chr(97 + i) for i in range(levels)]
    parts = [f"{names[0]}: &{names[0]} [x, x, x, x, x, x, x, x, x, x]"]
    parts += [f"{n}: &{n} [" + ", ".join([f"*{p}"] * 10) + "]" for p, n in zip(names, names[1:], strict=False)]
    return "{" + ", ".join(parts) + "}"


def set_value(rng: random.Random) -> str:
    """A ``--set`` value: valid, wrong-typed or hostile YAML."""
    pick = rng.randrange(24)
    if pick == 0:
        return str(rng.randint(-5, 40))
    if pick == 1:
        return str(rng.choice([2**31, 2**63, 2**64, -(2**70), 10**400]))
    if pick == 2:
        return rng.choice([".nan", ".inf", "-.inf", "1e39", "1e-400", "0x1F", "0o17", "1_000", "+12"])
    if pick == 3:
        return rng.choice(["true", "false", "null", "~", "yes", "off", "''", '""'])
    if pick == 4:
        return _bomb(rng.randint(3, 10))
    if pick == 5:
        return "[" * rng.randint(10, 400) + "1" + "]" * rng.randint(0, 400)
    if pick == 6:
        return "{a: " * rng.randint(10, 300) + "1" + "}" * rng.randint(0, 300)
    if pick == 7:
        return rng.choice(["!!python/object/apply:os.system [id]", "!!python/name:os.system", "!custom 3",
                           "!!binary aGVsbG8=", "!!set {a, b}", "!!omap [a: 1]", "!!int abc", "!!float x",
                           "!!timestamp 2001-12-14", "!<tag:yaml.org,2002:str> x"])
    if pick == 8:
        return "&a [*a]" if rng.random() < 0.5 else "*undefined"
    if pick == 9:
        return "".join(chr(rng.randrange(0, 0x250)) for _ in range(rng.randint(1, 40)))
    if pick == 10:
        return "x" * rng.choice([10, 10_000, 100_000, 1_000_000])
    if pick == 11:
        return rng.choice(["{kind: induction}", "{kind: nope}", "{kind: [induction]}", "{kind: 3}",
                           "{kind: repeated_tokens, n: 0}", "{kind: niah, distractors: 100000}",
                           "{memory: 1KiB}", "{guard: false}", "{memory: -3}", "{task.n: [1, 2]}",
                           "{task.n: [1, 1]}", "{steps.0.id: [a, b]}", "{executor: ray, address: 'x:1'}",
                           "{config: {model_type: gpt2, n_layer: 1000000}}", "{device_map: {a: disk}}"])
    if pick == 12:
        return ": : :" if rng.random() < 0.5 else "- - -\n  - x"
    if pick == 13:
        return "'unterminated" if rng.random() < 0.5 else '"\\x00\\uD800"'
    if pick == 14:
        return "\t" + "a:\n" * rng.randint(1, 5) + "  b"
    if pick == 15:
        return "[" + ", ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(0, 2000))) + "]"
    if pick == 16:
        return "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}"
    if pick == 17:
        return "\x00\x07\x1b[2J"
    if pick == 18:
        return "a: 1\nb: 2" if rng.random() < 0.5 else "---\n...\n---"
    if pick == 19:
        return "%YAML 1.1\n---\n1"
    if pick == 20:
        return "? [a, b]\n: 1"
    if pick == 21:
        return "{a: 1, a: 2}"
    if pick == 22:
        return str(rng.uniform(-10, 10))
    return rng.choice(["induction", "cpu", "cuda:3", "auto", "8GiB", "none", "memory://x", "~/runs", "../../x"])


VALID_SETS = ["task.n=2", "task.length=5", "seed=7", "seed=4294967295", "gen.max_new_tokens=3",
              "steps.1.generate.steer.0.factor=0.25", "steps.1.generate.steer.0.heads.top=1", "name=other",
              "task={kind: repeated_tokens, n: 2, length: 4}", "sweep={task.n: [2, 3]}", "limits.memory=8GiB",
              "limits={guard: false}", "model.device=cpu", "ind.kind=previous_token", "output=runs",
              "steps.1.generate.decode={kind: dola, layers: [0, 1]}", "model.config.hidden_size=64",
              "execution={executor: local}", "model.extrapolate=true", "sweep={seed: [0, 1]}"]


def set_items(rng: random.Random) -> list[str]:
    """One to three ``--set`` items: valid ones (about a third of the cases) and drawn ones."""
    if rng.random() < 0.35:
        return rng.sample(VALID_SETS, rng.randint(1, 3))
    items = []
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(SET_PATHS) if rng.random() < 0.9 else "".join(rng.choice("ab.0_") for _ in range(6))
        sep = "=" if rng.random() < 0.97 else rng.choice(["", "==", ":"])
        items.append(f"{path}{sep}{set_value(rng)}")
    return items


# --- lm-eval task mappings ------------------------------------------------------------------------

HONEST = ["{{ question }}", "Q: {{ question }}\nA:", "{{ answer }}", "{{ question | upper }}",
          "{% for c in choices %}{{ loop.index }}. {{ c }}\n{% endfor %}", "{{ choices[label] }}", "{{ label }}",
          "{{ question | regex_replace('a+', 'b') }}", "{{ ' '.join(choices) }}", "{{ question[:20] }}",
          "{{ '%s?' % question }}", "{{ question ~ '?' }}", "plain text", "", "{{ choices }}",
          "{% if label %}yes{% else %}no{% endif %}"]


def payload(rng: random.Random, marker: Path) -> str:
    """A template that would create ``marker`` if it reached Python."""
    act = rng.choice([f"os.system('touch {marker}')", f"os.popen('touch {marker}').read()",
                      f"__builtins__.open('{marker}', 'w').write('x')",
                      f"__builtins__['open']('{marker}', 'w').write('x')",
                      f"__builtins__.__import__('os').system('touch {marker}')"])
    base = rng.choice(["cycler", "joiner", "namespace", "lipsum", "range", "self", "config", "request", "dict",
                       "question", "choices", "loop", "''", "()", "[]", "{}", "1", "answer.__class__"])
    chain = rng.choice(["__init__.__globals__", "__class__.__init__.__globals__",
                        "__class__.__mro__[1].__subclasses__()[0].__init__.__globals__",
                        "__class__.__base__.__subclasses__()[137].__init__.__globals__",
                        "_TemplateReference__context.cycler.__init__.__globals__", "__self__.__globals__",
                        "__func__.__globals__", "__reduce_ex__(2)[0].__globals__"])
    forms = [
        f"{{{{ {base}.{chain}.{act} }}}}",
        f"{{{{ {base}[{chain.split('.')[0]!r}] }}}}",
        f"{{% set n = '_' ~ '_init__' %}}{{{{ ({base}[n]|attr('__glob' ~ 'als__')).{act} }}}}",
        f"{{{{ {base}|attr('__in' + 'it__')|attr('__globals__') }}}}",
        f"{{{{ ({base}|attr(['__', 'init', '__']|join)|attr('__globals__')).{act} }}}}",
        f"{{{{ [{base}]|map(attribute='__class__')|list }}}}",
        f"{{{{ '{{0.__class__}}'.format({base}) }}}}",
        f"{{{{ '%s' % {base}.__class__ }}}}",
        f"{{% for x in {base}.__class__.__mro__ %}}{{{{ x.__subclasses__() }}}}{{% endfor %}}",
        f"{{{{ {base}.__class__.__name__ }}}}{{{{ question }}}}",
        f"{{% set g = {base}.{chain} %}}{{{{ g.{act} }}}}",
        f"{{{{ {base}|attr('\\x5f\\x5finit\\x5f\\x5f') }}}}",
        f"{{{{ {base}.__getattribute__('__init__') }}}}",
        f"{{{{ {base}.__dict__ }}}}",
        f"{{% import 'os' as os %}}{{{{ os.{act} }}}}",
        f"{{% include '{marker}' %}}",
        "{{ question * 100000 * 100000 }}",
        "{% for i in range(10**9) %}x{% endfor %}",
    ]
    return rng.choice(forms)


def task_mapping(rng: random.Random, data: Path, marker: Path) -> dict[str, Any]:
    hostile = rng.random() < 0.7  # else an honest task (which must be accepted and render)

    def template() -> str:
        return payload(rng, marker) if hostile and rng.random() < 0.7 else rng.choice(HONEST)

    name = rng.choice(["fuzz_qa", "fuzz-mc", "x" * rng.randint(1, 80), "../x", ""]) if hostile else "fuzz_qa"
    task: dict[str, Any] = {"task": name,
                            "dataset_path": "json", "dataset_kwargs": {"data_files": {"validation": str(data)}},
                            "validation_split": "validation",
                            "output_type": rng.choice(["generate_until", "multiple_choice", "loglikelihood"]
                                                      + ["nope"] * hostile),
                            "doc_to_text": template(), "doc_to_target": template()}
    if rng.random() < 0.5:
        task["doc_to_choice"] = template() if rng.random() < 0.6 else ["yes", "no"]
    extra = rng.randrange(12) if hostile else 11
    if extra == 0:
        task["doc_to_text"] = f"!function {rng.choice(['utils.fn', 'os.system', 'mod.x'])}"
    elif extra == 1:
        task["metric_list"] = [{"metric": rng.choice(["./metric.py", str(marker.parent / 'm.py'), "bleurt",
                                                      "exact_match", "acc"])}]
    elif extra == 2:
        task["metric_list"] = [{"metric": "exact_match", "hf_evaluate": True}]
    elif extra == 3:
        task["dataset_kwargs"]["trust_remote_code"] = True
    elif extra == 4:
        task["process_docs"] = "!function utils.process_docs"
    elif extra == 5:
        task["filter_list"] = [{"name": "f", "filter": [{"function": "regex", "regex_pattern": payload(rng, marker)}]}]
    elif extra == 6:
        task["fewshot_config"] = {"sampler": "first_n", "doc_to_text": template()}
    elif extra == 7:
        task["generation_kwargs"] = {"until": [template()], "max_gen_toks": rng.choice([1, 10**9])}
    elif extra == 8:
        task["include"] = rng.choice(["/etc/passwd", "../x.yaml", str(marker)])
    elif extra == 9:
        task[rng.choice(["class", "__class__", "!function", "doc_to_decontamination_query"])] = template()
    elif extra == 10:
        task["num_fewshot"] = rng.choice([0, 5, 10**12, -1])
    return task


def lm_eval_case(rng: random.Random, data: Path, marker: Path) -> dict[str, Any]:
    step = {"id": "eval", "evaluate": {"tasks": [task_mapping(rng, data, marker)], "limit": 2,
                                       "include_defaults": False, "bootstrap_iters": 0}}
    if rng.random() < 0.05:
        step["evaluate"]["tasks"].append(rng.choice(["nq_open", "nope_task", {"task": "x"}]))
    return {"name": "fuzz", "model": "headlab-tiny", "task": {"kind": "repeated_tokens", "n": 1, "length": 4},
            "steps": [step]}


DOC = {"question": "The capital of France is Paris. What is the capital of France", "answer": "Paris",
       "choices": ["Paris", "Rome"], "label": 0}


def render_templates(spec: Any) -> None:
    """Render every string template of the accepted spec's inline task as lm-eval renders it, in the sandbox."""
    from lm_eval import utils

    from headlab.task_code import sandboxed_templates

    step = spec.steps[0].evaluate
    with sandboxed_templates():
        for task in step.tasks:
            if not isinstance(task, dict):
                continue
            for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
                value = task.get(key)
                if isinstance(value, str):
                    utils.apply_template(value, dict(DOC))
            for item in task.get("generation_kwargs", {}).get("until", []) or []:
                if isinstance(item, str):
                    utils.apply_template(item, dict(DOC))


# --- running the cases ------------------------------------------------------------------------------

def located(e: Any) -> bool:
    return e.line is not None or bool(e.path) or "--set" in str(e)


def classify(source: str, case: Any, timeout: float, marker: Path) -> tuple[str, str, float]:
    """Run one case; returns (outcome, detail, seconds)."""
    import headlab
    from headlab.cli import _parse_set
    from headlab.spec import SpecError

    started = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        if source == "set":
            loaded = headlab.load_spec(BASE)
            loaded.with_overrides(_parse_set(case))
            outcome, detail = "accepted", ""
        elif source == "lm_eval":
            loaded = headlab.load_spec(case)
            outcome, detail = "accepted", ""
            try:
                render_templates(loaded.spec)
                outcome = "rendered"
            except Hang:
                raise
            except Exception as e:  # noqa: BLE001 - a template the sandbox refused (SecurityError, a limit, ...)
                from jinja2.exceptions import SecurityError, TemplateError

                from headlab.sandbox import TemplateLimitError

                # OverflowError: Jinja2's sandboxed range() refusing more than MAX_RANGE items
                if isinstance(e, (SecurityError, TemplateError, TemplateLimitError)) or \
                        isinstance(e, OverflowError) and "sandbox" in str(e):
                    outcome, detail = "render_refused", f"{type(e).__name__}: {str(e)[:200]}"
                else:
                    raise
        else:
            headlab.load_spec(case)
            outcome, detail = "accepted", ""
    except SpecError as e:
        outcome, detail = ("refused" if located(e) else "unlocated"), str(e)[:300]
    except Hang:
        outcome, detail = "hang", f"interrupted after {timeout} s"
    except Exception as e:  # noqa: BLE001 - an escape is what we count
        outcome, detail = "escape", f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = time.perf_counter() - started
    if seconds > timeout and outcome != "hang":
        outcome, detail = "hang", f"{outcome} after {seconds:.1f} s: {detail}"
    if marker.exists():
        outcome, detail = "code_run", f"the payload ran ({outcome}: {detail})"
        marker.unlink()
    return outcome, detail, seconds


def warm_up(data: Path) -> None:
    """Import what the first case of each source would import (lm-eval takes seconds to import on a loaded
    machine), so that no case is timed over an import: one honest lm-eval task validated and rendered."""
    import headlab

    task = {"task": "warm_up", "dataset_path": "json", "dataset_kwargs": {"data_files": {"validation": str(data)}},
            "validation_split": "validation", "output_type": "generate_until", "doc_to_text": HONEST[0],
            "doc_to_target": "{{ answer }}", "metric_list": [{"metric": "exact_match"}]}
    spec = {"name": "fuzz", "model": "headlab-tiny", "task": {"kind": "repeated_tokens", "n": 1, "length": 4},
            "steps": [{"id": "eval", "evaluate": {"tasks": [task], "limit": 2, "include_defaults": False,
                                                  "bootstrap_iters": 0}}]}
    render_templates(headlab.load_spec(spec).spec)


def fuzz(n: int, seed: int, timeout: float = 5.0, shares: tuple[float, float] = (0.4, 0.4),
         progress: bool = False) -> dict[str, Any]:
    """Run ``n`` cases (``shares``: of ``set`` and ``lm_eval``; the rest are ``spec`` cases); the report."""
    import headlab

    headlab.load_spec(BASE)
    previous = signal.signal(signal.SIGALRM, _alarm)
    counts: collections.Counter[str] = collections.Counter()
    by_source: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    failures: list[dict[str, Any]] = []
    slowest: list[float] = []
    rng = random.Random(seed)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        marker = Path(tmp) / "MARKER"
        data = Path(tmp) / "qa.jsonl"
        data.write_text(json.dumps(DOC) + "\n" + json.dumps(DOC) + "\n")

        def check(source: str, case: Any) -> None:
            outcome, detail, seconds = classify(source, case, timeout, marker)
            counts[outcome] += 1
            by_source[source][outcome] += 1
            slowest.append(seconds)
            slowest.sort(reverse=True)
            del slowest[5:]
            if outcome in ("escape", "hang", "unlocated", "code_run") and len(failures) < 200:
                text = case if isinstance(case, str) else json.dumps(case, default=str)
                failures.append({"outcome": outcome, "source": source, "detail": detail, "input": text[:4000]})
            total = sum(counts.values())
            if progress and total % 1000 == 0:
                print(f"{total:6d} cases, {time.time() - started:6.0f} s: {dict(counts)}", flush=True)

        n_set, n_lm = round(n * shares[0]), round(n * shares[1])
        warm_up(data)
        for _ in range(n_set):
            check("set", set_items(rng))
        for _ in range(n_lm):
            check("lm_eval", lm_eval_case(rng, data, marker))
        n_spec = n - n_set - n_lm
        if n_spec > 0:
            import spec_strategies as S
            from hypothesis import HealthCheck, Phase, given, settings
            from hypothesis import seed as hseed

            @hseed(seed)
            @settings(max_examples=n_spec, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(S.mutated_specs())
            def one(case: tuple[str, Any]) -> None:
                check("spec", case[1])

            one()
    signal.signal(signal.SIGALRM, previous)
    return {"cases": sum(counts.values()), "seconds": round(time.time() - started, 1), "seed": seed,
            "timeout_s": timeout, "counts": dict(counts), "by_source": {k: dict(v) for k, v in by_source.items()},
            "escapes": counts["escape"], "hangs": counts["hang"], "unlocated": counts["unlocated"],
            "code_runs": counts["code_run"], "slowest_s": [round(s, 2) for s in slowest], "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="cases to try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds after which a case is a hang")
    parser.add_argument("--set-share", type=float, default=0.4, help="share of --set cases")
    parser.add_argument("--lm-eval-share", type=float, default=0.4, help="share of lm-eval task mapping cases")
    parser.add_argument("--out", type=Path, default=None, help="write counts and failing inputs as JSON")
    args = parser.parse_args()
    report = fuzz(args.n, args.seed, args.timeout, (args.set_share, args.lm_eval_share), progress=True)
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=2))
    for f in report["failures"][:20]:
        print(f"{f['outcome']} ({f['source']}): {f['detail']}\n    input: {f['input'][:300]!r}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    sys.exit(1 if report["escapes"] or report["hangs"] or report["code_runs"] else 0)


if __name__ == "__main__":
    main()
