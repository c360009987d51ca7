"""PASTA generation on the Triton path (CPU, TRITON_INTERPRET=1) == torch path == naive eager hooks.

TRITON_INTERPRET is read when ``headlab.kernels.triton_attention`` is imported (``triton.jit``), so this
module sets it first and reloads that module, as tests/test_kernels_triton.py does. With
``HEADLAB_TRITON_CUDA=1`` on a GPU it runs the compiled kernels.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

ON_CUDA = os.environ.get("HEADLAB_TRITON_CUDA") == "1" and torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

if "headlab.kernels.triton_attention" in sys.modules and not ON_CUDA:
    importlib.reload(sys.modules["headlab.kernels.triton_attention"])

sys.path.insert(0, os.path.dirname(__file__))
from test_steering_pasta import (  # noqa: E402
    bias_matrix,
    build_tokenizer,
    eager_pasta,
    emphasis_examples,
    headlab_generate,
    hf_generate,
    loaded,
    pasta_plan,
    tiny,
    two_section_example,
)

from headlab import instrument as ins  # noqa: E402
from headlab.generation import tokenize  # noqa: E402

pytestmark = pytest.mark.triton


def test_pasta_tokens_identical_triton_torch_eager():
    """Left-padded batch, one row with two emphasised sections, steered heads in both layers."""
    mode = "exclude"
    tok = build_tokenizer()
    examples = emphasis_examples(2, seed=5) + [two_section_example()]
    mh, me = tiny("headlab"), tiny("eager")
    batch = tokenize(loaded(mh), examples)
    heads = [(0, 1), (0, 3), (1, 0), (1, 2)]
    alpha = 0.01
    n_new = 5
    out = {}
    for backend in ("torch", "triton"):
        plan = pasta_plan(mh, batch, heads, alpha, mode, backend=backend)
        out[backend] = headlab_generate(mh, batch, plan, n_new)
    with eager_pasta(me, heads, bias_matrix(tok, batch, alpha, mode)):
        out["eager"] = hf_generate(me, batch, n_new).tolist()
    assert out["torch"] == out["triton"] == out["eager"]


def test_triton_path_is_really_taken():
    """The plan's backend reaches the kernel: recorded stats say triton, and steered logits match torch's."""
    mh = tiny("headlab")
    batch = tokenize(loaded(mh), emphasis_examples(2, seed=1))
    logits = {}
    for backend in ("torch", "triton"):
        plan = pasta_plan(mh, batch, [(0, 0), (1, 3)], 0.01, backend=backend)
        with ins.instrument(mh, plan), torch.no_grad():
            logits[backend] = mh(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    real = batch.attention_mask.bool()
    torch.testing.assert_close(logits["triton"][real], logits["torch"][real], atol=2e-5, rtol=0)
    from headlab.kernels import attention

    q = torch.randn(1, 2, 5, 16)
    _, st = attention(q, q[:, :1], q[:, :1], key_spans=torch.tensor([[[0, 2]]]),
                      key_bias=torch.full((1, 2, 1), -4.0), backend="triton")
    assert st.backend == "triton"
