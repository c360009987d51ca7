"""headlab: a lab bench for the attention heads of transformer language models.

Find the heads that do a job (detect), push on them (steer), decode with them (contrast) and
measure the effect, from a YAML spec, the command line or a notebook.

    >>> import headlab
    >>> run = headlab.run("specs/quickstart.yaml")          # doctest: +SKIP
    >>> run.results["induction"]["score"]                    # doctest: +SKIP
"""

from __future__ import annotations

from .context import IMAGE_MARKER, Example, StepContext, TaskContext, strip_tags
from .describe import StepDescription, describe_steps
from .dims import DIMENSIONS
from .errors import ContractError, StepError
from .forward_pass import forward, positions_from_mask
from .generation import Batch, instrumented, tokenize
from .heads import draw_like, from_pasta_json, from_retrieval_json, ranked, to_pasta_json, to_retrieval_json
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

#: the plugin surface (docs/plugins.md, "The public namespace"; the other public modules are listed there)
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
