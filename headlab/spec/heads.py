"""Head selections: how a spec names heads (``{from: step, top: k}``, pairs, layers, a file), and the
check that every ``heads: {from: id}`` names an earlier step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from ..config import StrictModel, suggest
from .errors import SpecError, _position, format_path
from .fields import MAX_INT, FiniteFloat, NonEmptyStr, NonNegativeInt, PositiveInt, Seed

__all__ = ["HeadSelection", "HeadsFile", "HeadsFrom", "LayerKey"]


class HeadsFrom(StrictModel):
    """Heads taken from an earlier step's ``score``: the ``top`` highest, or all above ``threshold``."""

    from_: str = Field(alias="from", description="id of an earlier step whose result has a `score`")
    top: PositiveInt | None = Field(None, description="take the k highest-scoring heads (at most the model's heads)")
    threshold: FiniteFloat | None = Field(None, description="take heads whose score is >= threshold")
    random: bool = Field(False, description="draw the same number of heads at random instead (control)")
    match_layers: bool = Field(False, description="random: as many heads per layer as the selection has")
    seed: Seed | None = Field(None, description="random: offset added to the run seed, so that several controls "
                             "in one cell draw different heads")
    allow_empty: bool = Field(False, description="a threshold that selects no head runs the step with no heads "
                              "(default: an error, since the step would silently run unsteered)")

    @model_validator(mode="after")
    def _one_rule(self) -> HeadsFrom:
        if self.top is None and self.threshold is None:
            raise ValueError("give `top` or `threshold`")
        if (self.match_layers or self.seed is not None) and not self.random:
            raise ValueError("`match_layers` and `seed` shape a random draw: add `random: true`")
        return self


class HeadsFile(StrictModel):
    """Heads from a JSON file: retrieval-head format ``{"<layer>-<head>": [scores]}`` (ranked by mean,
    with ``top``) or PASTA format ``{"<layer>": [heads]}`` / ``[layers]``."""

    file: NonEmptyStr
    top: PositiveInt | None = Field(None, description="take the k best heads of the file (at most the model's heads)")


def _layer_key(value: Any) -> Any:
    """A key of PASTA's ``{"<layer>": [heads]}``: a layer number, written as digits (a YAML integer key is
    taken as its digits); anything else is refused here, naming the key, rather than mid-run."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT:
        return str(value)
    if isinstance(value, str) and value.isascii() and value.isdigit() and int(value) <= MAX_INT:
        return value
    raise PydanticCustomError(
        "layer_key", "layer key {key} is not a layer number: a head map is {\"<layer>\": [heads]} with each layer "
        "written as a number 0 .. {most}, e.g. {\"3\": [0, 5]}", {"key": repr(value)[:60], "most": f"{MAX_INT:,}"})


LayerKey = Annotated[str, Field(pattern=r"^[0-9]+$"), BeforeValidator(_layer_key)]
"""A layer of PASTA's head map ``{"<layer>": [heads]}``: digits (``"3"``; a YAML integer key ``3`` is taken as
``"3"``), at most :data:`~headlab.spec.MAX_INT`."""


def _heads_form(value: Any) -> str:
    """Which form of head selection ``value`` is, so an error names the form's own key (``top``), not another's."""
    if isinstance(value, HeadsFrom) or (isinstance(value, Mapping) and ("from" in value or "from_" in value)):
        return "heads[from]"
    if isinstance(value, HeadsFile) or (isinstance(value, Mapping) and "file" in value):
        return "heads[file]"
    return "heads[layers]" if isinstance(value, Mapping) else "heads[pairs]"


HeadSelection = Annotated[
    Union[  # noqa: UP007
        Annotated[HeadsFrom, Tag("heads[from]")], Annotated[HeadsFile, Tag("heads[file]")],
        Annotated[list[tuple[NonNegativeInt, NonNegativeInt]], Tag("heads[pairs]")],
        Annotated[dict[LayerKey, list[NonNegativeInt]], Tag("heads[layers]")]],
    Discriminator(_heads_form)]
"""How a spec names heads: ``{from: step, top: k}``, ``[[layer, head], ...]``, ``{"<layer>": [heads]}``
or ``{file: heads.json}``."""


def _check_references(spec: Any, tree: Any, source: str) -> None:
    """Every ``heads: {from: id}`` names an earlier step that produces scores."""
    earlier: dict[str, str] = {}
    for i, step in enumerate(spec.steps):
        for path, ref in _find_refs(step.model_dump(by_alias=True), ["steps", i]):
            if ref not in earlier:
                line, col = _position(tree, path) if tree is not None else (None, None)
                hint = suggest(ref, earlier)
                where = "a later step" if ref in {s.id for s in spec.steps} else "no step"
                raise SpecError(f"'{ref}' is {where}; heads can only come from an earlier step{hint}",
                                source=source, line=line, col=col, path=format_path(path))
        earlier[step.id] = step.action


def _find_refs(node: Any, path: list[Any]) -> Iterable[tuple[list[Any], str]]:
    if isinstance(node, Mapping):
        if isinstance(node.get("from"), str):
            yield [*path, "from"], node["from"]
        for k, v in node.items():
            if v is not None:
                yield from _find_refs(v, [*path, k])
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _find_refs(v, [*path, i])

