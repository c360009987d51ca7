"""The example of `heads` in docs/plugins.md, "Utilities for plugins": it runs with ``lm`` (a loaded
model) and ``examples`` (``headlab.Example``s with targets) given, as tests/test_docs_plugins.py runs it."""
# ruff: noqa: F821

# --8<-- [start:example]
import numpy as np

from headlab import draw_like, to_pasta_json
from headlab.dims import head_array

geo = lm.geometry
per_example = head_array(np.random.default_rng(0).random((len(examples), geo.n_layers, geo.n_heads)), "example")
score = per_example.mean("example")        # (layer, head), coordinates 0..n-1
best = np.argsort(-score.values, axis=None)[:2]
top = [(int(layer), int(head)) for layer, head in zip(*np.unravel_index(best, score.shape), strict=True)]
pool = [(layer, head) for layer in range(geo.n_layers) for head in range(geo.n_heads)]
controls = draw_like(top, pool, np.random.default_rng(1), exclude=True)   # as many other heads, at random
pasta = to_pasta_json(top)                 # {"<layer>": [heads]}, PASTA's format
# --8<-- [end:example]
