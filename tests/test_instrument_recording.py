"""Recording.to_xarray / to_dataset: the recorded tensors with named dims and coordinates.

Independent checks: every value equals the tensor the Recording hands out; coordinates are the probe's
own inputs (layers, spans, offsets, z positions) and the absolute positions; ``.sel`` by a coordinate
picks the same numbers as indexing the tensor by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import headlab
from headlab import instrument as ins

ins.register()

V, N, PAD = 97, 9, 3


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="headlab").eval()


def inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (2, N), generator=g)
    am = torch.ones(2, N, dtype=torch.long)
    am[1, :PAD] = 0
    return ids, am


def record(model, probes, ids, am):
    with torch.no_grad(), ins.instrument(model, ins.Plan(probes=probes)) as rec:
        model(input_ids=ids, attention_mask=am)
    return rec


def test_every_array_keeps_its_values_under_its_dims(model):
    ids, am = inputs()
    spans = [[(0, 2), (4, 7)], [(PAD, PAD + 1)]]
    probes = ins.Probes(argmax=True, entropy=True, spans=spans, offsets=[1, 0, 3], z_positions=[2, N - 1],
                        pattern=True, layers=[0, 2], pairs=[[(5, 3), (2, 2)], [(N - 1, PAD)]],
                        kv_positions=[2, N - 1], q_positions=[2, N - 1])
    rec = record(model, probes, ids, am)
    assert set(rec.as_dict()) == set(ins.DIMS)
    for name, tensor in rec.as_dict().items():
        da = rec.to_xarray(name)
        assert da.dims == ins.DIMS[name] and da.name == name
        assert set(da.dims) <= set(headlab.DIMENSIONS)
        np.testing.assert_array_equal(da.values, tensor.cpu().numpy())
        assert da["example"].values.tolist() == [0, 1]
        assert da["layer"].values.tolist() == [0, 2]
        heads = da.dims[2]  # head, or kv_head for the keys and values
        assert da[heads].values.tolist() == ([0, 1, 2, 3] if heads == "head" else [0, 1])
        if "query" in da.dims:
            assert da["query"].values.tolist() == list(range(N))
    pattern = rec.to_xarray("pattern")
    assert pattern["key"].values.tolist() == list(range(N))
    z = rec.to_xarray("z")
    assert z["position"].values.tolist() == [2, N - 1] and "head_dim" not in z.coords
    k = rec.to_xarray("k")
    assert k["position"].values.tolist() == [2, N - 1] and rec.kv_positions == [2, N - 1]
    np.testing.assert_array_equal(k.sel(position=N - 1, layer=2, kv_head=1).values, rec.k[:, 1, 1, 1].numpy())
    # coordinates select what indexing the tensors by hand selects
    sm = rec.to_xarray("span_mass")
    assert sm["span_start"].values.tolist() == [[0, 4], [PAD, 0]]
    assert sm["span_end"].values.tolist() == [[2, 7], [PAD + 1, 0]]
    om = rec.to_xarray("offset_mass")
    assert om["offset"].values.tolist() == [1, 0, 3]
    np.testing.assert_array_equal(om.sel(offset=3, layer=2, query=N - 1).values,
                                  rec.offset_mass[:, 1, :, N - 1, 2].numpy())
    np.testing.assert_array_equal(z.sel(position=N - 1, layer=2).values, rec.z[:, 1, :, 1].numpy())
    np.testing.assert_array_equal(pattern.sel(layer=0, query=5, key=3).values, rec.pattern[:, 0, :, 5, 3].numpy())
    pm = rec.to_xarray("pair_mass")
    assert pm["pair_query"].values.tolist() == [[5, 2], [N - 1, -1]]
    assert pm["pair_key"].values.tolist() == [[3, 2], [PAD, -1]]
    np.testing.assert_array_equal(pm.sel(layer=2, pair=0).values[0], rec.pattern[0, 1, :, 5, 3].numpy())
    np.testing.assert_array_equal(pm.sel(layer=2, pair=0).values[1], rec.pattern[1, 1, :, N - 1, PAD].numpy())


def test_to_dataset_holds_every_recorded_array(model):
    ids, am = inputs()
    rec = record(model, ins.Probes(argmax=True, entropy=True, z_positions="last"), ids, am)
    ds = rec.to_dataset()
    assert set(ds.data_vars) == {"argmax", "argmax_prob", "entropy", "z"}
    assert ds.attrs["calls"] == 1 and ds.attrs["layers"] == [0, 1, 2]
    assert dict(ds.sizes) == {"example": 2, "layer": 3, "head": 4, "query": N, "position": 1, "head_dim": 16}
    np.testing.assert_array_equal(ds["argmax"].values, rec.argmax.numpy())
    assert not headlab.dims.unknown_dims(ds)


def test_per_row_offsets_become_a_delta_coordinate(model):
    ids, am = inputs()
    rec = record(model, ins.Probes(offsets=[[0, 1], [2]]), ids, am)
    om = rec.to_xarray("offset_mass")
    assert om["offset"].values.tolist() == [0, 1]
    assert om["delta"].dims == ("example", "offset") and om["delta"].values.tolist() == [[0, 1], [2, -1]]
    np.testing.assert_array_equal(om.values, rec.offset_mass.numpy())


def test_generate_concatenates_queries_and_z_positions(model):
    ids, am = inputs()
    new = 3
    probes = ins.Probes(argmax=True, z_positions="last")
    with torch.no_grad(), ins.instrument(model, ins.Plan(probes=probes)) as rec:
        model.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, do_sample=False, pad_token_id=0)
    am_da = rec.to_xarray("argmax")
    assert am_da["query"].values.tolist() == list(range(N + new - 1))
    z = rec.to_xarray("z")
    assert z["position"].values.tolist() == list(range(N - 1, N + new - 1)) == rec.z_positions


def test_bfloat16_becomes_float32_and_errors_are_named(model):
    ids, am = inputs()
    m16 = model.to(torch.bfloat16)
    try:
        rec = record(m16, ins.Probes(z_positions="last", argmax=True), ids, am)
    finally:
        model.to(torch.float32)
    z = rec.to_xarray("z")
    assert rec.z.dtype == torch.bfloat16 and z.dtype == np.float32
    np.testing.assert_array_equal(z.values, rec.z.float().numpy())
    with pytest.raises(KeyError, match="span_mass"):
        rec.to_xarray("nope")
    with pytest.raises(ValueError, match="not recorded"):
        rec.to_xarray("pattern")


def test_generate_records_the_keys_and_values_of_each_step(model):
    """The keys and values each call adds, concatenated over a ``generate``, equal those of one forward over
    the prompt and the generated tokens (a token's key and value do not depend on later tokens)."""
    ids, am = inputs()
    new = 3
    with torch.no_grad(), ins.instrument(model, ins.Plan(probes=ins.Probes(kv_positions="all"))) as rec:
        out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert rec.kv_positions == list(range(N + new - 1))
    full_am = torch.cat([am, torch.ones(2, new, dtype=torch.long)], dim=1)
    positions = (full_am.cumsum(-1) - 1).clamp(min=0)  # as generate counts them: left padding at 0
    with torch.no_grad(), ins.instrument(model, ins.Plan(probes=ins.Probes(kv_positions="all"))) as full:
        model(input_ids=out, attention_mask=full_am, position_ids=positions)
    real = am.bool()[:, None, None, :].expand(-1, 3, 2, -1)  # the prompt's real tokens, and then every step
    torch.testing.assert_close(rec.k[..., :N, :][real], full.k[..., :N, :][real], atol=1e-5, rtol=0)
    torch.testing.assert_close(rec.v[..., N:, :], full.v[..., N:N + new - 1, :], atol=1e-5, rtol=0)
    torch.testing.assert_close(rec.k[..., N:, :], full.k[..., N:N + new - 1, :], atol=1e-5, rtol=0)
