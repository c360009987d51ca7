"""The model spec: which model a spec loads and how (:class:`ModelSpec`).

A spec that names no model gets the model registered with ``default=True`` (see
:func:`headlab.hookspecs.headlab_register_models`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..config import StrictModel
from ..plugin_manager import Registry, get_manager
from .fields import NonEmptyStr, NonNegativeInt
from .limits import parse_size

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
    device_map: Literal["auto", "balanced", "balanced_low_0", "sequential"] | dict[str, NonNegativeInt | str] | None \
        = Field(
        None, description="place the model's modules on several devices through accelerate: 'auto' (fill the GPUs, "
        "then the CPU, then disk) or a mapping from module names to a GPU index, 'cpu' or 'disk' (e.g. "
        "{model.embed_tokens: 0, model.layers.0: 0, model.layers.1: cpu, model.norm: cpu, lm_head: cpu}); "
        "instead of `device`")
    max_memory: dict[str, Annotated[int, Field(ge=1, le=2**62)] | str] | None = Field(
        None, description="with device_map: the most each device may hold, e.g. {0: 20GiB, cpu: 60GiB}")
    offload_folder: NonEmptyStr | None = Field(
        None, description="with device_map: the directory for the weights placed on 'disk'")
    extrapolate: bool = Field(False, description="run prompts (plus generated tokens) longer than the model's context "
                              "window (max_position_embeddings / n_positions): a legitimate experiment on RoPE models, "
                              "refused unless asked for")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        """A device torch knows (whether this machine has it is checked when the model loads)."""
        if value == "auto":
            return value

        try:
            if not re.fullmatch(DEVICE_PATTERN, value) or torch.device(value).type not in ("cpu", "cuda", "mps", "xpu"):
                raise ValueError(value)
        except (RuntimeError, ValueError, TypeError):
            raise PydanticCustomError(
                "unknown_device", "unknown device '{device}': use auto, cpu, cuda, cuda:<index>, mps or xpu",
                {"device": value}) from None
        return value

    @field_validator("device_map")
    @classmethod
    def _known_places(cls, value: Any) -> Any:
        """Every place of a device_map mapping is a GPU index, 'cpu' or 'disk' (or a cuda device string)."""
        if isinstance(value, dict):
            if not value:
                raise ValueError("device_map is empty: map module names to devices, or use device_map: auto")
            for module, place in sorted(value.items(), key=lambda item: str(item[0])):  # the first bad one, whatever the order
                if isinstance(place, bool) or not (isinstance(place, int) and place >= 0 or place in ("cpu", "disk")
                                                   or isinstance(place, str) and re.fullmatch(r"cuda(:\d+)?", place)):
                    raise ValueError(f"device_map[{module!r}] is {place!r}: give a GPU index (0, 1, ...), 'cpu' or "
                                     "'disk'")
        return value

    @field_validator("max_memory")
    @classmethod
    def _memory_sizes(cls, value: Any) -> Any:
        """Keys are GPU indices, 'cpu' or 'disk'; values sizes such as 20GiB."""
        if value is None:
            return value

        for key, size in sorted(value.items(), key=lambda item: str(item[0])):
            if not (str(key).isdigit() or key in ("cpu", "disk")):
                raise ValueError(f"max_memory key '{key}': give a GPU index (0, 1, ...), 'cpu' or 'disk'")
            try:
                parse_size(size)
            except (ValueError, TypeError) as e:
                raise ValueError(f"max_memory[{key!r}]: {e}") from None
        return value

    @model_validator(mode="after")
    def _placement(self) -> ModelSpec:
        if self.device_map is None:
            if self.max_memory is not None or self.offload_folder is not None:
                given = "max_memory" if self.max_memory is not None else "offload_folder"
                raise ValueError(f"{given} needs device_map (auto, or a mapping of modules to devices)")
            return self
        if self.device != "auto":
            raise ValueError(f"give device ({self.device!r}) or device_map, not both: device_map places every module")
        if isinstance(self.device_map, dict) and "disk" in self.device_map.values() and self.offload_folder is None:
            raise ValueError("device_map puts modules on 'disk': give offload_folder, the directory for their weights")
        return self

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
