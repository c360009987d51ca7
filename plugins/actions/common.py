"""What the decoding actions (``generate``, ``score``) share: their common config fields and steering."""

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import Field, model_validator

from headlab import Plan
from headlab.generation import Batch
from headlab.scoring import steering_plan as core_steering_plan
from headlab.spec import PositiveInt, SpecTypes, StrictModel


def kind_shorthand(value: Any) -> Any:
    """A bare string in a list of components is the kind: ``[exact_match]`` = ``[{kind: exact_match}]``."""
    return {"kind": value} if isinstance(value, str) else value


def decoding_config(types: SpecTypes) -> type[StrictModel]:
    """The base config of a decoding action: ``decode`` (a step without it uses the default decoder),
    ``steer`` (steering methods applied together) and ``batch_size``."""
    Decoder, Steer = types.union("decoders"), types.union("steering")
    default = types.default("decoders")
    about = "decoding strategy" + (f" (default: {default.kind_name()})" if default is not None else "")

    class Decoding(StrictModel):
        decode: Decoder = Field(description=about)
        steer: list[Steer] = Field(default_factory=list, description="steering methods applied together")
        batch_size: PositiveInt = Field(8, description="prompts (generate) or prompt+choice rows (score) per forward")

        @model_validator(mode="before")
        @classmethod
        def default_decoder(cls, data: Any) -> Any:
            """A missing ``decode`` is the default decoder."""
            if default is not None and isinstance(data, Mapping) and data.get("decode") is None:
                data = {**data, "decode": {"kind": default.kind_name()}}
            return data

    return Decoding


def steering_plan(steer: list[Any], ctx: Any, batch: Batch) -> tuple[Plan | None, list[Callable[[], Any]]]:
    """The instrumentation plan of the steering methods ``steer`` for ``batch`` (None without any), and
    the reports they returned (called once the batch is generated): :func:`headlab.scoring.steering_plan`."""
    return core_steering_plan(steer, ctx, batch)
