"""Pytest fixtures shared by every test module, and the environment the suite runs in (offline, Triton
interpreted on CPU). Helpers that test modules import live in tests/fixtures/ (``fixtures.specs``, ...)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker: -n auto already uses every core
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton kernels run under the interpreter on CPU; it is read when kernels are decorated, so it must be set
# before any test module imports triton. HEADLAB_TRITON_CUDA=1 keeps compiled kernels on a GPU machine.
if os.environ.get("HEADLAB_TRITON_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def tiny_llama() -> dict:
    """A config mapping for a 2-layer, 4-head (2 kv heads) Llama with random weights."""
    # imported here, not on top: fixtures.specs imports headlab, which must load after the environment is set
    from fixtures.specs import TINY_LLAMA

    return dict(TINY_LLAMA)
