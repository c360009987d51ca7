"""The model spec: which model a spec loads and how (:class:`ModelSpec`).

A spec that names no model gets the model registered with ``default=True`` (see
:func:`headlab.hookspecs.headlab_register_models`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..config import StrictModel
from ..plugin_manager import Registry, get_manager
from .fields import NonEmptyStr

__all__ = ["DEVICE_PATTERN", "ModelSpec", "default_model"]


#: the devices a spec may name: torch's device strings with an index of 0..127 (torch wraps larger ones)
DEVICE_PATTERN = r"^(auto|cpu|(cuda|mps|xpu)(:([0-9]|[1-9][0-9]|1[01][0-9]|12[0-7]))?)$"


class ModelSpec(StrictModel):
    """Which model to load and how. A bare string in the spec is the ``id``."""

    id: NonEmptyStr | None = Field(None, description="Hugging Face id, local directory, or registered name")
    path: NonEmptyStr | None = Field(None, description="local directory with a Hugging Face checkpoint")
    config: dict[str, Any] | None = Field(
        None, description="build from a transformers config mapping (needs `model_type`) with random weights")
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    device: str = Field("auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...",
                        json_schema_extra={"pattern": DEVICE_PATTERN})
    trust_remote_code: bool = False
    extrapolate: bool = Field(False, description="run prompts (plus generated tokens) longer than the model's context "
                              "window (max_position_embeddings / n_positions): a legitimate experiment on RoPE models, "
                              "refused unless asked for")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        """A device torch knows (whether this machine has it is checked when the model loads)."""
        if value == "auto":
            return value
        import torch

        try:
            if not re.fullmatch(DEVICE_PATTERN, value) or torch.device(value).type not in ("cpu", "cuda", "mps", "xpu"):
                raise ValueError(value)
        except (RuntimeError, ValueError, TypeError):
            raise PydanticCustomError(
                "unknown_device", "unknown device '{device}': use auto, cpu, cuda, cuda:<index>, mps or xpu",
                {"device": value}) from None
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        given = [k for k in ("id", "path", "config") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give only one of id, path, config (got {', '.join(given)})")
        if not given:
            name = default_model()
            if name is None:
                raise ValueError("no model is registered as the default: give id, path or config")
            self.id = name
        return self

    @property
    def name(self) -> str:
        """A short human-readable name for the model."""
        if self.config is not None:
            return f"random-{self.config.get('model_type', 'model')}"
        return str(self.path or self.id)


def default_model(registry: Registry | None = None) -> str | None:
    """The name of the model registered with ``default=True`` (in ``registry``, by default the plugin
    manager's), or None when no plugin registers one."""
    comp = (registry or get_manager().registry).default("models")
    return None if comp is None else comp.kind
