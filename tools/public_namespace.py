"""The public namespace of headlab: the modules a plugin imports from, what each is for, and the names of each
module's ``__all__``.

tools/mkdocs_hooks.py renders :func:`namespace_page` as the API reference's "Public namespace" page;
tests/test_public_api.py holds every plugin, the example package and the templates to :data:`PUBLIC_MODULES`.
"""

from __future__ import annotations

import importlib

#: the modules plugins import from, with what each is for
PUBLIC_MODULES: dict[str, str] = {
    "headlab.plugin": "the plugin author's facade: everything the new-plugin templates and the example package use",
    "headlab": "running and reading runs, registration, models, forwards, plans and their typed edits, recordings",
    "headlab.spec": "advanced: the spec's models, limits and every field type",
    "headlab.generation": "advanced: the decoding loop's options, requests and results, scoring continuations",
    "headlab.masking": "advanced: greedy outputs with chosen heads masked (the causal check's machinery), batches "
                       "by length",
    "headlab.pattern_scores": "advanced: the pattern detectors' scores of attention against a detection pattern",
    "headlab.decoding": "advanced: utilities for decoding strategies",
    "headlab.resources": "advanced: memory estimates and task sizes for the resource guard",
    "headlab.dims": "advanced: dimension names and (layer, head) arrays",
    "headlab.anatomy": "advanced: the modules and per-head weights of a model",
    "headlab.text": "advanced: ROUGE and the words of the shape scenes",
    "headlab.scoring": "advanced: scores, generations and metric values outside a run; a task's examples",
    "headlab.sandbox": "advanced: the Jinja2 sandbox of task templates",
    "headlab.task_code": "advanced: checks of lm-evaluation-harness task files",
    "headlab.lm_eval": "advanced: the lm-evaluation-harness bridge",
    "headlab.kv": "advanced: head-level KV-cache policies: head maps, KV-head selections, the headwise cache",
    "headlab.roles": "advanced: a labelled head cube (detector, layer, head) as rows: roles, head cards, top heads",
}


def exported(module: str) -> set[str] | None:
    """``module.__all__`` (None when the module has none)."""
    names = getattr(importlib.import_module(module), "__all__", None)
    return None if names is None else set(names)


def namespace_page(api_pages: dict[str, str] | None = None) -> str:
    """The "Public namespace" page: each public module, what it is for, and the names of its ``__all__`` in
    alphabetical order; a module named in ``api_pages`` (module -> page) links to its own API page."""
    api_pages = api_pages or {}
    out = ["# Public namespace", "",
           "The modules a plugin imports from (the guide's Plugins page says which are for what), each with the",
           "names of its `__all__`, generated from the installed modules when the site is built.", ""]
    for module, about in PUBLIC_MODULES.items():
        names = sorted(exported(module) or (), key=lambda n: (n.lower().lstrip("_"), n))
        title = f"[`{module}`]({api_pages[module]})" if module in api_pages else f"`{module}`"
        out += [f"## {title}", "", f"{about[0].upper()}{about[1:]}.", "", ", ".join(f"`{n}`" for n in names), ""]
    return "\n".join(out)
