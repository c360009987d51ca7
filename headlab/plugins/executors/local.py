"""The ``local`` executor (the default): every cell in this process, one after another, in sweep order.

The first cell's model is loaded before the run store is created, so its provenance is in the run's
attributes from the start and a model that cannot be loaded leaves no store behind. A cell that
raises is recorded as failed (cell, step, error) and the exception propagates: the run stops there,
and ``headlab run --resume RUN`` continues from that cell.
"""

from typing import Literal

from pydantic import Field

from headlab.plugin import ComponentConfig, hookimpl
from headlab.runner import Job


class LocalExecutor(ComponentConfig):
    """Run the cells in this process, one after another (the default)."""

    kind: Literal["local"] = Field("local", alias="executor")


def execute(config: LocalExecutor, job: Job) -> None:
    """Run ``job.cells`` here with the driver's models."""
    model = job.models.get(job.spec.for_cell(job.cells[0]).model) if job.cells else None
    job.start(model)
    for cell in job.cells:
        if job.cancelled():
            raise KeyboardInterrupt
        job.run_cell(cell)


@hookimpl
def headlab_register_executors(register):
    register(LocalExecutor, execute, default=True)
