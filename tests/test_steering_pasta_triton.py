"""PASTA generation on the Triton path (CPU, TRITON_INTERPRET=1) == torch path == naive eager hooks.

TRITON_INTERPRET must be set before triton itself is first imported (triton's own ``tl.zeros`` & co. are
``triton.jit`` functions decorated at import), and in a full test session another module may import
triton earlier. So the comparison runs in a fresh subprocess (this file run as a script) whose environment
sets it; the test asserts on the JSON it prints. With ``HEADLAB_TRITON_CUDA=1`` on a GPU it runs the
compiled kernels in the subprocess instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.triton
HERE = os.path.dirname(os.path.abspath(__file__))


def compare() -> dict:
    """Tokens and logits of PASTA-steered generation on every path (run inside the subprocess)."""
    import torch

    from headlab import instrument as ins
    from headlab.generation import tokenize
    from headlab.kernels import HeadEdits, attention

    from fixtures.steering import (
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

    dev = "cuda" if os.environ.get("HEADLAB_TRITON_CUDA") == "1" else "cpu"
    tok = build_tokenizer()
    examples = emphasis_examples(2, seed=5) + [two_section_example()]
    mh, me = tiny("headlab").to(dev), tiny("eager").to(dev)
    batch = tokenize(loaded(mh), examples, device=dev)
    heads = [(0, 1), (0, 3), (1, 0), (1, 2)]
    out: dict = {}
    logits = {}
    import headlab.kernels.triton_attention as ta

    calls = {"n": 0}
    real_kernel = ta.triton_attention

    def counted(*a, **kw):
        calls["n"] += 1
        return real_kernel(*a, **kw)

    ta.triton_attention = counted  # the dispatcher imports it lazily, per call
    for backend in ("torch", "triton"):
        calls["n"] = 0
        plan = pasta_plan(mh, batch, heads, 0.01, "exclude", backend=backend)
        out[backend] = headlab_generate(mh, batch, plan, 5)
        plan = pasta_plan(mh, batch, heads, 0.01, "exclude", backend=backend)
        with ins.instrument(mh, plan), torch.no_grad():
            logits[backend] = mh(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        out[f"{backend}_kernel_calls"] = calls["n"]
    with eager_pasta(me, heads, bias_matrix(tok, batch, 0.01, "exclude").to(dev)):
        out["eager"] = hf_generate(me, batch, 5).tolist()
    real = batch.attention_mask.bool()
    out["logit_diff"] = float((logits["triton"][real] - logits["torch"][real]).abs().max())
    q = torch.randn(1, 2, 5, 16, device=dev)
    edits = HeadEdits(key_spans=torch.tensor([[[0, 2]]], device=dev), key_bias=torch.full((1, 2, 1), -4.0, device=dev))
    _, st = attention(q, q[:, :1], q[:, :1], edits=edits, backend="triton")
    out["backend"] = st.backend
    return out


def test_pasta_tokens_identical_triton_torch_eager():
    """Left-padded batch, one row with two emphasised sections, steered heads in both layers."""
    pytest.importorskip("triton")
    env = dict(os.environ)
    if env.get("HEADLAB_TRITON_CUDA") != "1":
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, env=env,
                       cwd=HERE, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["backend"] == "triton"
    assert res["torch_kernel_calls"] == 0 and res["triton_kernel_calls"] >= 2 * 6  # 2 layers x 6 forwards
    assert res["torch"] == res["triton"] == res["eager"]
    assert res["logit_diff"] < 2e-5


if __name__ == "__main__":
    print(json.dumps(compare()))
