"""The example of `instrumented` in docs/plugins.md, "Utilities for plugins": it runs with ``lm`` (a loaded
model) and ``examples`` (``headlab.Example``s with targets) given, as tests/test_docs_plugins.py runs it."""
# ruff: noqa: F821

# --8<-- [start:example]
import torch

from headlab import Plan, Probes, instrumented, positions_from_mask, tokenize

batch = tokenize(lm, examples)
with torch.no_grad(), instrumented(lm, Plan(probes=Probes(argmax=True))) as rec:
    lm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
             position_ids=positions_from_mask(batch.attention_mask))
top_key_again = rec.to_xarray("argmax")
# --8<-- [end:example]
