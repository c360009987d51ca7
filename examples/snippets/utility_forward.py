"""The example of `forward` in docs/plugins.md, "Utilities for plugins": it runs with ``lm`` (a loaded
model) and ``examples`` (``headlab.Example``s with targets) given, as tests/test_docs_plugins.py runs it."""
# ruff: noqa: F821

# --8<-- [start:example]
import headlab

batch = headlab.tokenize(lm, examples)
out, rec = headlab.forward(lm, batch, headlab.Plan(probes=headlab.Probes(argmax=True)))
top_key = rec.to_xarray("argmax")          # (example, layer, head, query): the key each query attends to most
next_token = out.logits[:, -1].argmax(-1)  # the greedy next token of every prompt
# --8<-- [end:example]
