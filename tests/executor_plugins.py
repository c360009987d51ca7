"""A plugin for the executor tests, importable by worker processes (tests/ is on their PYTHONPATH).

- action ``probe``: logs every attempt (cell value and process id) to ``log``, raises while the file
  ``fail_while`` exists (for the cell whose ``value`` is ``fail_value``), SIGKILLs its own process the
  first time a cell with ``value == kill_value`` runs (creating the marker ``kill_once``), and returns
  a seeded random draw, so results show whether seeding is the same everywhere;
- model ``counted-tiny``: the tiny random Llama, each load appended (process id) to the file named by
  ``HEADLAB_TEST_LOADS``.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import torch
import xarray as xr

from headlab import hookimpl
from headlab.model import load_model
from headlab.spec import ModelSpec, StrictModel

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 97, "max_position_embeddings": 256}


class Probe(StrictModel):
    """Log the attempt; fail, or kill the process, on request; return a seeded draw."""

    log: str
    value: int = 0
    fail_value: int | None = None
    fail_while: str | None = None
    kill_value: int | None = None
    kill_once: str | None = None


def probe(config: Probe, ctx) -> xr.Dataset:
    with open(config.log, "a") as f:
        f.write(f"{config.value} {os.getpid()}\n")
    if config.fail_while and config.value == config.fail_value and os.path.exists(config.fail_while):
        raise RuntimeError(f"injected fault in cell value {config.value}")
    if config.kill_once and config.value == config.kill_value and not os.path.exists(config.kill_once):
        with open(config.kill_once, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    draw = torch.rand(3).numpy()
    return xr.Dataset({"draw": ("k", draw), "value": ((), np.int64(config.value))})


def load_counted(spec: ModelSpec):
    path = os.environ.get("HEADLAB_TEST_LOADS")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
    return load_model(ModelSpec(config=TINY_LLAMA, device="cpu"), seed=0)


@hookimpl
def headlab_register_actions(register):
    register("probe", Probe, probe, description="test action: log, fail or kill on request")


@hookimpl
def headlab_register_models(register):
    register("counted-tiny", load_counted, "the tiny random Llama; loads are logged")
