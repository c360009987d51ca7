"""The example of `text` in docs/plugins.md, "Utilities for plugins": it runs with ``lm`` (a loaded
model) and ``examples`` (``headlab.Example``s with targets) given, as tests/test_docs_plugins.py runs it."""
# ruff: noqa: F821

# --8<-- [start:example]
from headlab.text import rouge1

precision, recall, f1 = rouge1("the key is 42", "I think the key is 42")
# --8<-- [end:example]
