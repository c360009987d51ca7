"""headlab: a lab bench for the attention heads of transformer language models.

Find the heads that do a job (detect), push on them (steer), decode with them (contrast) and
measure the effect, from a YAML spec, the command line or a notebook.

    >>> import headlab
    >>> run = headlab.run("specs/quickstart.yaml")          # doctest: +SKIP
    >>> run.results["induction"]["score"]                    # doctest: +SKIP

The names of ``__all__`` load their module on first use, and so does ``headlab.<submodule>``: ``import
headlab`` alone loads nothing else of headlab, so that importing one part (``headlab.instrument``) loads only
what that part imports.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import IMAGE_MARKER, Example, StepContext, TaskContext, strip_tags
    from .describe import StepDescription, describe_steps
    from .dims import DIMENSIONS
    from .errors import ContractError, StepError
    from .forward_pass import forward, positions_from_mask
    from .generation import Batch, instrumented, tokenize
    from .heads import (
        draw_like,
        from_pasta_json,
        from_retrieval_json,
        ranked,
        to_pasta_json,
        to_retrieval_json,
    )
    from .hookspecs import hookimpl
    from .image_attention import attention_preview
    from .instrument import (
        AddZ,
        DropResidGrad,
        KeyBias,
        Plan,
        Probes,
        Recording,
        ReplaceKV,
        ReplaceQ,
        ReplaceResid,
        ReplaceZ,
        SteeringConflictError,
        shared_trunk,
        span_tensor,
        start_at_layer,
    )
    from .model import Geometry, LoadedModel, from_config, from_pretrained, load_model
    from .overview import SummaryRow, summary_rows
    from .plugin_manager import PluginError, component, register_plugin, unregister_plugin
    from .results import Run, list_runs, open_run
    from .runner import run
    from .scoring import generate, logprobs
    from .spec import ComponentConfig, HeadSelection, SpecError, json_schema, load_spec
    from .summary import Estimate, estimate, head_scores
    from .version import __version__
    from .vision import token_runs

#: each public name and the module of the package that defines it
_HOME = {
    "IMAGE_MARKER": "context", "Example": "context", "StepContext": "context", "TaskContext": "context",
    "strip_tags": "context",
    "StepDescription": "describe", "describe_steps": "describe",
    "DIMENSIONS": "dims",
    "ContractError": "errors", "StepError": "errors",
    "forward": "forward_pass", "positions_from_mask": "forward_pass",
    "Batch": "generation", "instrumented": "generation", "tokenize": "generation",
    "draw_like": "heads", "from_pasta_json": "heads", "from_retrieval_json": "heads", "ranked": "heads",
    "to_pasta_json": "heads", "to_retrieval_json": "heads",
    "hookimpl": "hookspecs",
    "attention_preview": "image_attention",
    "AddZ": "instrument", "DropResidGrad": "instrument", "KeyBias": "instrument", "Plan": "instrument",
    "Probes": "instrument", "Recording": "instrument", "ReplaceKV": "instrument", "ReplaceQ": "instrument",
    "ReplaceResid": "instrument", "ReplaceZ": "instrument", "SteeringConflictError": "instrument",
    "shared_trunk": "instrument", "span_tensor": "instrument", "start_at_layer": "instrument",
    "Geometry": "model", "LoadedModel": "model", "from_config": "model", "from_pretrained": "model",
    "load_model": "model",
    "SummaryRow": "overview", "summary_rows": "overview",
    "PluginError": "plugin_manager", "component": "plugin_manager", "register_plugin": "plugin_manager",
    "unregister_plugin": "plugin_manager",
    "Run": "results", "list_runs": "results", "open_run": "results",
    "run": "runner",
    "generate": "scoring", "logprobs": "scoring",
    "ComponentConfig": "spec", "HeadSelection": "spec", "SpecError": "spec", "json_schema": "spec",
    "load_spec": "spec",
    "Estimate": "summary", "estimate": "summary", "head_scores": "summary",
    "__version__": "version",
    "token_runs": "vision",
}

#: the plugin surface (docs/plugins.md, "The public namespace"; tools/public_namespace.py lists the other public modules)
__all__ = [
    # running and reading runs
    "Run", "list_runs", "load_spec", "json_schema", "open_run", "run", "generate", "logprobs", "SpecError",
    "StepError", "__version__", "StepDescription", "SummaryRow", "describe_steps", "summary_rows",
    # writing a plugin: registration and the objects a component receives
    "ComponentConfig", "ContractError", "Example", "HeadSelection", "IMAGE_MARKER", "PluginError", "StepContext",
    "TaskContext", "component", "hookimpl", "register_plugin", "strip_tags", "unregister_plugin",
    # models, batches and forwards
    "Batch", "Geometry", "LoadedModel", "forward", "from_config", "from_pretrained", "load_model",
    "positions_from_mask", "token_runs", "tokenize",
    # steering plans and recordings
    "AddZ", "DropResidGrad", "KeyBias", "Plan", "Probes", "Recording", "ReplaceKV", "ReplaceQ", "ReplaceResid",
    "ReplaceZ",
    "SteeringConflictError",
    "instrumented", "shared_trunk", "span_tensor", "start_at_layer",
    # heads and result arrays
    "DIMENSIONS", "Estimate", "attention_preview", "estimate", "head_scores", "draw_like", "from_pasta_json",
    "from_retrieval_json", "ranked", "to_pasta_json",
    "to_retrieval_json",
]


def __getattr__(name: str) -> Any:
    """A public name, from the module that defines it, or a submodule of the package (imported on first use)."""
    home = _HOME.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f".{home}", __name__), name)
    elif name.isidentifier() and not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names and the attributes already loaded (what completion offers)."""
    return sorted({*globals(), *__all__})
