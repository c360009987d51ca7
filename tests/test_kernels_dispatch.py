"""headlab.kernels.choose_backend: the one place that decides which path computes an attention call.

A table of calls -> (backend, reason), the errors, and that attention() and the instrument report what it
decided (AttentionStats.backend / .reason, Recording.backends).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from headlab.kernels import HeadEdits, ProbeRequest, attention, choose_backend

# the module (``headlab.kernels.attention`` the attribute is the function)
kattn = importlib.import_module("headlab.kernels.attention")

B, H = 2, 4
ONES = torch.ones(B, H)
SPANS = torch.tensor([[[0, 3]], [[1, 4]]])
FINITE = HeadEdits(key_spans=SPANS, key_bias=torch.full((B, H, 1), math.log(0.1)))
INFINITE = HeadEdits(key_spans=SPANS, key_bias=torch.full((B, H, 1), -math.inf))
SCALES = HeadEdits(q_scale=ONES, out_scale=ONES * 0.5)
SCORE = HeadEdits(score_zero=torch.zeros(B, H, dtype=torch.bool))
ARGMAX = ProbeRequest(argmax=True)
NO_OFFSETS = ProbeRequest(offsets=torch.zeros(B, 0, dtype=torch.long))  # a probe, even with no columns
PAIRS = ProbeRequest(pairs=torch.tensor([[[1, 0]], [[2, 2]]]))
TORCH_PAIRS = "pairs read off each query block's normalised attention"
TRITON_PAIRS = "pairs from the rows' log-sum-exp (pair kernel)"

# (requested, edits, probes, softcap, device, native, reads_outputs) -> (backend, reason)
CASES = [
    (("auto", None, None, None, "cpu", False, False), ("sdpa", "no edits or probes")),
    (("auto", HeadEdits(), ProbeRequest(), None, "cpu", False, False), ("sdpa", "no edits or probes")),
    (("auto", None, None, None, "cpu", True, False), ("native", "no edits or probes")),
    (("auto", None, None, None, "cuda", True, False), ("native", "no edits or probes")),
    (("auto", SCALES, None, None, "cpu", True, False), ("native", "query/output scales only")),
    (("auto", SCALES, None, None, "cpu", False, False), ("sdpa", "query/output scales only")),
    (("auto", SCALES, None, None, "cpu", True, True), ("sdpa", "query/output scales only; head outputs are read")),
    (("auto", None, None, None, "cpu", True, True), ("sdpa", "no edits or probes; head outputs are read")),
    (("auto", FINITE, None, None, "cpu", True, False), ("sdpa", "finite key biases")),
    (("auto", FINITE, None, None, "cuda", False, False), ("sdpa", "finite key biases")),
    (("sdpa", SCALES, None, None, "cpu", True, False), ("native", "query/output scales only")),
    (("sdpa", FINITE, None, None, "cpu", False, False), ("sdpa", "finite key biases")),
    (("auto", INFINITE, None, None, "cpu", True, False), ("torch", "an infinite key bias; not on CUDA")),
    (("auto", SCORE, None, None, "cpu", True, False), ("torch", "score zeroing; not on CUDA")),
    (("auto", None, ARGMAX, None, "cpu", True, False), ("torch", "probes; not on CUDA")),
    (("auto", None, NO_OFFSETS, None, "cpu", False, False), ("torch", "probes; not on CUDA")),
    (("auto", None, None, 30.0, "cpu", True, False), ("torch", "softcap; not on CUDA")),
    (("auto", SCORE, ARGMAX, 30.0, "cpu", False, False), ("torch", "probes; not on CUDA")),  # first blocker
    (("auto", None, ARGMAX, None, "cuda", True, False), ("triton", "probes; CUDA")),
    (("auto", None, None, 50.0, torch.device("cuda", 0), True, False), ("triton", "softcap; CUDA")),
    (("torch", None, None, None, "cpu", True, False), ("torch", "requested")),
    (("torch", INFINITE, ARGMAX, 30.0, "cuda", True, False), ("torch", "requested")),
    (("triton", SCALES, None, None, "cpu", True, False), ("triton", "requested")),
    # pair probes: the reason also says how the chosen path computes them
    (("auto", None, PAIRS, None, "cpu", True, False), ("torch", f"probes; not on CUDA; {TORCH_PAIRS}")),
    (("auto", SCORE, PAIRS, None, "cuda", False, False), ("triton", f"probes; CUDA; {TRITON_PAIRS}")),
    (("torch", None, PAIRS, None, "cuda", True, False), ("torch", f"requested; {TORCH_PAIRS}")),
    (("triton", None, PAIRS, None, "cpu", True, False), ("triton", f"requested; {TRITON_PAIRS}")),
]


@pytest.mark.parametrize("call,expected", CASES, ids=[f"{i}-{e[0]}" for i, (_, e) in enumerate(CASES)])
def test_choose_backend_table(call, expected, monkeypatch):
    monkeypatch.setattr(kattn, "triton_available", lambda: True)
    requested, edits, probes, softcap, device, native, reads = call
    got = choose_backend(requested, edits=edits, probes=probes, softcap=softcap, device=device, native=native,
                         reads_outputs=reads)
    assert got == expected


def test_a_differentiated_call_takes_the_torch_path_on_cuda(monkeypatch):
    monkeypatch.setattr(kattn, "triton_available", lambda: True)
    forward_only = "(the Triton path is forward-only)"
    assert choose_backend(probes=ARGMAX, device="cuda", grad=True) == ("torch", f"probes; gradients {forward_only}")
    assert choose_backend(softcap=30.0, device="cuda", native=True, grad=True) == (
        "torch", f"softcap; gradients {forward_only}")
    assert choose_backend(probes=PAIRS, device="cuda", grad=True) == (
        "torch", f"probes; gradients {forward_only}; {TORCH_PAIRS}")
    assert choose_backend(device="cuda", native=True, grad=True) == ("native", "no edits or probes")  # SDPA: autograd
    assert choose_backend(probes=ARGMAX, device="cpu", grad=True) == ("torch", "probes; not on CUDA")
    with pytest.raises(ValueError, match="backend='triton' is forward-only and this call is differentiated"):
        choose_backend("triton", probes=ARGMAX, device="cuda", grad=True)
    q = torch.zeros(1, 2, 3, 4)
    with torch.no_grad():
        assert not kattn.needs_grad(q.requires_grad_(True))
    assert kattn.needs_grad(None, q) and not kattn.needs_grad(torch.zeros(2), None)


def test_the_instrument_asks_for_gradients_only_where_autograd_records(monkeypatch):
    """A forward whose later layers are differentiated (AtP's leaf on a head output): on CUDA those layers'
    attention would be Triton's, which is forward-only; the dispatcher is told, layer by layer."""
    from headlab.instrument import Plan, Probes, instrument

    from fixtures.circuits import models

    _, lm, _ = models("llama")
    seen: list[bool] = []
    real = kattn.choose_backend

    def spy(*args, grad=False, **kwargs):
        seen.append(grad)
        return real(*args, grad=grad, **kwargs)

    import headlab.instrument.attention as iattn

    monkeypatch.setattr(iattn, "choose_backend", spy)
    ids = torch.tensor([[5, 6, 7, 8]])
    leaf = torch.zeros(1, 4, lm.model.config.hidden_size, requires_grad=True)
    hook = lm.model.model.layers[0].register_forward_hook(lambda m, a, o: (o[0] + leaf, *o[1:]) if isinstance(o, tuple)
                                                          else o + leaf)
    try:
        with instrument(lm.model, Plan(probes=Probes(argmax=True))):
            out = lm.model(input_ids=ids)
        assert seen == [True, True]  # the weights require grad: autograd records every layer
        seen.clear()
        lm.model.requires_grad_(False)
        with instrument(lm.model, Plan(probes=Probes(argmax=True))):
            out = lm.model(input_ids=ids)
        assert seen == [False, True]  # frozen weights: layer 0 reads no leaf, layer 1 reads layer 0's output + leaf
        seen.clear()
        with torch.no_grad(), instrument(lm.model, Plan(probes=Probes(argmax=True))):
            lm.model(input_ids=ids)
        assert seen == [False, False]
    finally:
        hook.remove()
    out.logits.sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0


def test_choose_backend_without_triton(monkeypatch):
    monkeypatch.setattr(kattn, "triton_available", lambda: False)
    assert choose_backend(probes=ARGMAX, device="cuda") == ("torch", "probes; triton is not installed")
    assert choose_backend(edits=FINITE, device="cuda") == ("sdpa", "finite key biases")
    assert choose_backend(probes=PAIRS, device="cuda") == ("torch", f"probes; triton is not installed; {TORCH_PAIRS}")


def test_choose_backend_errors():
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_backend("flash")
    with pytest.raises(ValueError, match="native"):
        choose_backend("native")  # an answer, never a request
    for edits, probes, softcap, what in [(None, ARGMAX, None, "probes"), (SCORE, None, None, "score zeroing"),
                                         (INFINITE, None, None, "an infinite key bias"),
                                         (None, None, 2.0, "softcap")]:
        with pytest.raises(ValueError, match=f"backend=.sdpa. takes .*this call has {what}"):
            choose_backend("sdpa", edits=edits, probes=probes, softcap=softcap, native=True)


def test_attention_reports_the_choice_and_takes_dataclasses():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, 6, 8, generator=g) for _ in range(3))
    edits = HeadEdits(q_scale=torch.tensor([[1.0, 0.0, 2.0, 1.0]] * B), key_spans=SPANS,
                      key_bias=torch.full((B, H, 1), -2.0))
    out_dc, st = attention(q, k, v, edits=edits, probes=ProbeRequest(argmax=True, pattern=True), scale=0.3)
    assert (st.backend, st.reason) == ("torch", "probes; not on CUDA")
    # None stands for no edits / no probes
    out_none, st_none = attention(q, k, v, probes=ARGMAX, scale=0.3)
    out_empty, st_empty = attention(q, k, v, edits=HeadEdits(), probes=ARGMAX, scale=0.3)
    assert torch.equal(out_none, out_empty) and torch.equal(st_none.argmax, st_empty.argmax)
    assert not torch.equal(out_none, out_dc)  # the edits change the output
    _, st = attention(q, k, v, edits=edits, scale=0.3)
    assert (st.backend, st.reason) == ("sdpa", "finite key biases")
    _, st = attention(q, k, v, edits=edits, scale=0.3, backend="torch")
    assert (st.backend, st.reason) == ("torch", "requested")
    # the edits and probes come as HeadEdits / ProbeRequest only
    with pytest.raises(TypeError, match="out_scale"):
        attention(q, k, v, out_scale=ONES, scale=0.3)
    with pytest.raises(TypeError, match="probe_entropy"):
        attention(q, k, v, probe_entropy=True, scale=0.3)


def test_head_edits_helpers():
    assert HeadEdits().is_empty() and not SCALES.is_empty()
    more = FINITE.plus_key_bias(torch.tensor([[[4, 6]], [[0, 1]]]), torch.zeros(B, H, 1))
    assert more.key_spans.shape == (B, 2, 2) and more.key_bias.shape == (B, H, 2)
    assert torch.equal(more.key_spans[:, :1], SPANS)
    only = HeadEdits().plus_key_bias(SPANS, torch.zeros(B, H, 1))
    assert only.key_spans is SPANS
    dense = HeadEdits(q_scale=0.5, score_zero=True).checked(B, H, "cpu")
    assert dense.q_scale.shape == (B, H) and dense.q_scale.dtype == torch.float32
    assert dense.score_zero.dtype == torch.bool and bool(dense.score_zero.all())
    assert HeadEdits(key_spans=torch.zeros(B, 0, 2), key_bias=torch.zeros(B, H, 0)).checked(B, H, "cpu").is_empty()
    assert not ProbeRequest().any() and NO_OFFSETS.any()


def test_instrument_records_the_choice_per_layer():
    """The instrument asks choose_backend for every layer call and records what it decided."""
    import transformers

    from headlab import instrument as ins

    ins.register()
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=50, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ins.ATTN_IMPLEMENTATION).eval()
    ids = torch.randint(1, 50, (2, 7))
    plan = ins.Plan(probes=ins.Probes(argmax=True, layers=[2])).mask_heads([(0, 1)], mode="query")
    plan.bias_keys([(1, 0)], [(0, 3)], math.log(0.1))
    with torch.no_grad(), ins.instrument(model, plan) as rec:
        model(input_ids=ids)
    assert rec.backends == {0: ("native", "query/output scales only"), 1: ("sdpa", "finite key biases"),
                            2: ("torch", "probes; not on CUDA")}
    with torch.no_grad(), ins.instrument(model, ins.Plan(probes=ins.Probes(z_positions="last"))) as rec:
        model(input_ids=ids)
    assert set(rec.backends.values()) == {("sdpa", "no edits or probes; head outputs are read")}
