"""The ``detect`` action: score heads with a detector (``detect: {kind: induction, ...}``)."""

from typing import Any

import xarray as xr

from headlab import component
from headlab.plugin import ContractError, StepContext, hookimpl
from headlab.spec import SpecTypes


def detect_config(types: SpecTypes) -> Any:
    """A detect step's value is one detector config."""
    return types.union("detectors")


def detect(config: Any, ctx: StepContext) -> xr.Dataset:
    """Run the detector ``config.kind``; its dataset gets the attribute ``method`` (the kind) if unset."""
    ds = component("detectors", config.kind).impl(config, ctx)
    if not isinstance(ds, xr.Dataset):
        raise ContractError(f"the detector returned {type(ds).__name__}, not an xarray Dataset",
                            category="detectors", kind=config.kind)
    ds.attrs.setdefault("method", config.kind)
    return ds


@hookimpl
def headlab_register_actions(register):
    register("detect", detect_config, detect, description="score heads")
