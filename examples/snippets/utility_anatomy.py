"""The example of `anatomy` in docs/plugins.md, "Utilities for plugins": it runs with ``lm`` (a loaded
model) and ``examples`` (``headlab.Example``s with targets) given, as tests/test_docs_plugins.py runs it."""
# ruff: noqa: F821

# --8<-- [start:example]
import torch

from headlab.anatomy import head_weights

hw = head_weights(lm.model, 0)             # layer 0: W_Q, W_K, W_V, W_O, biases, kv_head_of
ov = hw.per_query_head(hw.W_V) @ hw.W_O    # (head, d_model, d_model): each head's OV circuit
ov_norm = torch.linalg.matrix_norm(ov)     # one number per head of layer 0
# --8<-- [end:example]
