"""headlab: a lab bench for the attention heads of transformer language models.

Find the heads that do a job (detect), push on them (steer), decode with them (contrast) and
measure the effect, from a YAML spec, the command line or a notebook.

    >>> import headlab
    >>> run = headlab.run("specs/quickstart.yaml")          # doctest: +SKIP
    >>> run.results["induction"]["score"]                    # doctest: +SKIP
"""

from __future__ import annotations

from .context import Example, StepContext, TaskContext
from .dims import DIMENSIONS
from .errors import StepError
from .forward import forward, positions_from_mask
from .generation import Batch, tokenize
from .hookspecs import hookimpl
from .instrument import Plan, Probes, Recording
from .plugin_manager import PluginError, component, register_plugin, unregister_plugin
from .results import Run, list_runs, open_run
from .runner import run
from .scoring import generate, logprobs
from .spec import ComponentConfig, HeadSelection, SpecError, json_schema, load_spec
from .version import __version__

__all__ = [
    "DIMENSIONS", "Batch", "ComponentConfig", "Example", "HeadSelection", "Plan", "PluginError", "Probes",
    "Recording", "Run", "SpecError", "StepContext", "StepError", "TaskContext", "__version__", "component",
    "forward", "generate", "hookimpl", "json_schema", "list_runs", "load_spec", "logprobs", "open_run",
    "positions_from_mask", "register_plugin", "run", "tokenize", "unregister_plugin",
]
