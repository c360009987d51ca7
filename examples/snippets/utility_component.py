"""The example of `component` in docs/plugins.md, "Utilities for plugins": it runs with ``lm`` (a loaded
model) and ``examples`` (``headlab.Example``s with targets) given, as tests/test_docs_plugins.py runs it."""
# ruff: noqa: F821

# --8<-- [start:example]
import headlab

recall = headlab.component("metrics", "needle_recall")
config = recall.config(raw=True, reference="target")
values = recall.impl(config, examples, [f"it is {ex.target}" for ex in examples])  # one number per example
# --8<-- [end:example]
