"""A complete plugin module, a metric: docs/plugins.md, "One complete example per kind", shows it, and
tests/test_docs_plugins.py registers it and checks what it computes."""

# --8<-- [start:example]
from typing import Literal

import numpy as np

from headlab.plugin import ComponentConfig, Example, hookimpl


class Characters(ComponentConfig):
    """Length of the output in characters."""

    kind: Literal["characters"] = "characters"


def compute(config: Characters, examples: list[Example], outputs: list[str]) -> np.ndarray:
    return np.array([len(output) for output in outputs], dtype=float)


@hookimpl
def headlab_register_metrics(register):
    register(Characters, compute)
# --8<-- [end:example]
