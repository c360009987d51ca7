"""Attention over images: headlab.image_attention's pieces against independent computations, the image panel's
values (ImagePatchView, AttentionView with a tiny random LLaVA) against an eager-attention forward, and
the image figure of ``headlab report``."""

from __future__ import annotations

import io
import re
from html.parser import HTMLParser

import numpy as np
import pytest
import xarray as xr

from headlab.image_attention import (
    PREVIEW_ATTENTION,
    PREVIEW_IMAGE,
    image_array,
    image_attention_svg,
    patch_grid,
    png_bytes,
    png_data_uri,
    preview_of,
    resize_image,
)
from headlab.report import color, render_report
from headlab.results import RunWriter, open_run

PIL = pytest.importorskip("PIL.Image")

from fixtures.figures import embedded  # noqa: E402
from fixtures.image_attention import LLAVA, QWEN2_VL, eager_attention, picture, vlm_example  # noqa: E402


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def tags(html: str) -> list[tuple[str, dict[str, str | None]]]:
    p = Tags()
    p.feed(html)
    return p.tags


# --------------------------------------------------------------------------- pieces
def test_image_array_from_pil_path_and_arrays(tmp_path):
    arr = picture()
    img = PIL.fromarray(arr)
    assert np.array_equal(image_array(img), arr)
    img.save(tmp_path / "x.png")
    assert np.array_equal(image_array(tmp_path / "x.png"), arr)
    assert np.array_equal(image_array(str(tmp_path / "x.png")), arr)
    gray = arr[:, :, 0]
    assert np.array_equal(image_array(gray), np.stack([gray] * 3, axis=-1))
    rgba = np.concatenate([arr, np.full(arr.shape[:2] + (1,), 7, np.uint8)], axis=-1)
    assert np.array_equal(image_array(rgba), arr)
    assert np.array_equal(image_array(np.array([[[0.0, 0.5, 1.0]]])), [[[0, 128, 255]]])
    with pytest.raises(ValueError, match="image array"):
        image_array(np.zeros((2, 2, 2)))


def test_png_round_trips_through_pillow():
    arr = picture(7, 5)
    data = png_bytes(arr)
    assert np.array_equal(np.asarray(PIL.open(io.BytesIO(data)).convert("RGB")), arr)
    uri = png_data_uri(arr)
    import base64

    assert uri.startswith("data:image/png;base64,") and base64.b64decode(uri.split(",", 1)[1]) == data


def test_resize_keeps_aspect_and_small_images():
    arr = picture(12, 20)
    assert resize_image(arr, 64) is not None and resize_image(arr, 64).shape == (12, 20, 3)
    assert resize_image(arr, 10).shape == (6, 10, 3)


def test_patch_grid_is_reading_order():
    vals = np.arange(2 * 6, dtype=float).reshape(2, 6)
    g = patch_grid(vals, (2, 3))
    assert g.shape == (2, 2, 3)
    for i in range(2):
        for k in range(6):
            assert g[i, k // 3, k % 3] == vals[i, k]
    with pytest.raises(ValueError, match="do not fill"):
        patch_grid(vals, (4, 4))


def test_image_attention_svg_cells_carry_values_and_colours():
    vals = np.array([[0.1, 0.4, 0.0], [0.2, np.nan, 0.3]])
    svg = image_attention_svg(picture(), vals, title="L1H2")
    rects = [a for t, a in tags(svg) if t == "rect" and a.get("class") == "patch"]
    assert len(rects) == 6
    for a in rects:
        r, c = int(a["data-row"]), int(a["data-col"])
        v = vals[r, c]
        assert a["data-value"] == ("nan" if np.isnan(v) else f"{v:.4g}")
        assert a["fill"] == color(v, 0.0, 0.4)
    images = [a for t, a in tags(svg) if t == "image"]
    assert len(images) == 1 and images[0]["href"].startswith("data:image/png;base64,")
    assert "http" not in svg.replace('xmlns="http://www.w3.org/2000/svg"', "")


# --------------------------------------------------------------------------- the widget
def test_image_patch_view_values_and_clicked_patch():
    pytest.importorskip("anywidget")
    from headlab.widgets import ImagePatchView

    vals = np.linspace(0, 1, 12)
    v = ImagePatchView.from_values(picture(), (3, 4), vals, token_start=7)
    assert (v.rows, v.cols) == (3, 4) and v.image.startswith("data:image/png;base64,")
    np.testing.assert_array_equal(v.grid_values, vals.reshape(3, 4))
    v.selected = 6  # what a click on the patch does from the browser
    assert v.patch() == {"row": 1, "col": 2, "token": 13, "value": vals[6]}
    v.set_values((3, 4), [None] * 12)
    assert np.isnan(v.grid_values).all()
    with pytest.raises(ValueError, match="do not fill"):
        v.set_values((2, 2), vals)


# --------------------------------------------------------------------------- report
def synthetic_run(tmp_path, *, with_score: bool = True, with_preview: bool = True):
    rng = np.random.default_rng(0)
    n_layers, n_heads, rows, cols = 3, 4, 3, 5
    att = rng.random((n_layers, n_heads, rows, cols)).astype(np.float32)
    data = {PREVIEW_IMAGE: (("pixel_y", "pixel_x", "channel"), picture(15, 25)),
            PREVIEW_ATTENTION: (("layer", "head", "patch_row", "patch_col"), att)}
    score = rng.random((n_layers, n_heads))
    if with_score:
        data["score"] = (("layer", "head"), score)
    ds = xr.Dataset(data, coords={"layer": np.arange(n_layers), "head": np.arange(n_heads)},
                    attrs={"action": "detect" if with_score else "other", "method": "segment_divergence"})
    ds[PREVIEW_ATTENTION].attrs.update(query=9, image_tokens=[2, 17])
    if not with_preview:
        ds = ds.drop_vars([PREVIEW_IMAGE, PREVIEW_ATTENTION])
    spec = "name: vlm\nmodel: tiny\ntask: {kind: shapes}\nsteps:\n  - id: vhd\n    detect: {kind: segment_divergence}\n"
    writer = RunWriter.create(tmp_path / "run", {"name": "vlm", "spec_text": spec, "status": "complete",
                                                 "sweep": {}, "steps": ["vhd"], "cells_total": 1})
    writer.write_cell("c0000", {}, {"vhd": ds}, {})
    return open_run(tmp_path / "run"), score, att


def test_report_draws_the_top_heads_attention_over_the_image(tmp_path):
    run, score, att = synthetic_run(tmp_path)
    ds = run.results["vhd"]
    found = preview_of(ds)
    assert found is not None and np.array_equal(found[0], picture(15, 25))
    html = render_report(run)
    fig = html[html.index("attention over the image"):]
    svgs = re.findall(r'<svg[^>]*class="image-attention".*?</svg>', fig, flags=re.S)
    assert len(svgs) == 3
    order = np.argsort(-score.reshape(-1), kind="stable")
    for svg, flat in zip(svgs, order[:3], strict=True):
        layer, head = divmod(int(flat), score.shape[1])
        assert f"L{layer}H{head}" in svg
        rects = [a for t, a in tags(svg) if t == "rect" and a.get("class") == "patch"]
        got = np.array([float(a["data-value"]) for a in rects]).reshape(3, 5)
        np.testing.assert_allclose(got, att[layer, head], rtol=1e-3)
    assert "from token #9" in fig


def test_report_without_score_ranks_heads_by_image_mass(tmp_path):
    run, _, att = synthetic_run(tmp_path, with_score=False)
    html = render_report(run)
    svg = re.findall(r'<svg[^>]*class="image-attention".*?</svg>', html, flags=re.S)[0]
    layer, head = divmod(int(np.argmax(att.sum((2, 3)))), att.shape[1])
    assert f"L{layer}H{head}" in svg


def test_report_of_a_text_run_has_no_image_figure(tmp_path):
    run, _, _ = synthetic_run(tmp_path, with_preview=False)
    assert preview_of(run.results["vhd"]) is None
    html = render_report(run)
    assert "image-attention" not in html and "attention over the image" not in html
    assert [name for name, _ in embedded(html)] == ["vhd: score"]  # the head map is drawn, nothing else


# --------------------------------------------------------------------------- a tiny random LLaVA
@pytest.fixture(scope="module")
def vlm():
    from headlab.model import load_model
    from headlab.plugin_manager import get_manager
    from headlab.spec import ModelSpec

    if "headlab-tiny" not in get_manager().components["models"]:
        pytest.skip("the embedded model headlab-tiny (the tokenizer) is not in this checkout")
    return load_model(ModelSpec(config=dict(LLAVA), device="cpu"))



def test_image_token_attention_and_preview_equal_eager_attention(vlm):
    from headlab.generation import tokenize
    from headlab.image_attention import attention_preview, image_token_attention

    batch = tokenize(vlm, [vlm_example()])
    (a, b), = batch.image_spans[0]
    grid = batch.image_grids[0][0]
    assert grid == (4, 4) and b - a == 16
    assert all(t == vlm.image_token_id for t in batch.input_ids[0, a:b].tolist())
    ref = eager_attention(vlm, batch)  # (layer, head, query, key)
    q = batch.length - 1
    got = image_token_attention(vlm, batch)[0]
    assert got.shape == (3, 8, 4, 4)
    for layer in range(3):
        for head in range(8):
            for k in range(b - a):
                assert abs(got[layer, head, k // 4, k % 4] - ref[layer, head, q, a + k]) < 1e-5
    # another query: a text token after the image
    np.testing.assert_allclose(image_token_attention(vlm, batch, query=b + 1)[0].reshape(3, 8, -1),
                               ref[:, :, b + 1, a:b], atol=1e-5)
    pre = attention_preview(vlm, vlm_example())
    assert pre[PREVIEW_ATTENTION].dims == ("layer", "head", "patch_row", "patch_col")
    np.testing.assert_allclose(pre[PREVIEW_ATTENTION].values.reshape(3, 8, -1), ref[:, :, q, a:b], atol=1e-5)
    assert pre[PREVIEW_ATTENTION].attrs == {"query": q, "image_tokens": [a, b]}
    assert pre[PREVIEW_IMAGE].dtype == np.uint8 and pre[PREVIEW_IMAGE].dims == ("pixel_y", "pixel_x", "channel")
    from headlab.context import Example

    assert len(attention_preview(vlm, Example(prompt="the cat sat")).data_vars) == 0


def test_model_view_is_the_image_the_model_reads(vlm):
    from headlab.generation import tokenize
    from headlab.image_attention import model_view

    square = picture(16, 16)  # the processor's own size: no resize, no crop
    batch = tokenize(vlm, [vlm_example(PIL.fromarray(square))])
    seen = model_view(vlm, batch, 0)
    assert seen.shape == (16, 16, 3) and np.abs(seen.astype(int) - square.astype(int)).max() <= 1
    assert model_view(vlm, batch, 1) is None


@pytest.mark.parametrize("mode", ["pattern", "query"])
def test_attention_view_image_panel_shows_the_attention_to_each_patch(vlm, mode):
    from headlab.generation import tokenize
    from headlab.widgets import AttentionView

    ex = vlm_example()
    batch = tokenize(vlm, [ex])
    ref = eager_attention(vlm, batch)
    (a, b), = batch.image_spans[0]
    view = AttentionView(vlm, example=ex, layer=2, head=5, mode=mode)
    assert view.mode == mode and len(view.image_views) == 1
    panel = view.image_views[0]
    q = batch.length - 1
    assert (panel.rows, panel.cols, panel.token_start) == (4, 4, a)
    np.testing.assert_allclose(panel.grid_values.reshape(-1), ref[2, 5, q, a:b], atol=1e-5)
    panel.selected = 6  # a click on patch (1, 2)
    p = panel.patch()
    assert (p["row"], p["col"], p["token"]) == (1, 2, a + 6) and abs(p["value"] - ref[2, 5, q, a + 6]) < 1e-5
    assert f"token #{a + 6}: {ref[2, 5, q, a + 6]:.6f}" in view.info.value
    # the token strip: the image is one chip carrying the image's attention mass
    chips = [(pos, t, x) for pos, t, x in view.shown if t.startswith("[image")]
    assert chips == [(a, "[image 4 x 4]", pytest.approx(float(ref[2, 5, q, a:b].sum()), abs=1e-5))]
    assert len(view.view.tokens) == batch.length - (b - a) + 1 and view.view.image_spans == [[a, b]]
    assert view.view.positions == [p for p in range(batch.length) if not a < p < b]
    # other head and a query after the image
    view.set(layer=1, head=3, query=b + 1)
    np.testing.assert_allclose(panel.grid_values.reshape(-1), ref[1, 3, b + 1, a:b], atol=1e-5)
    np.testing.assert_allclose(view.image_attention(0, 0, 7, q).reshape(-1), ref[0, 7, q, a:b], atol=1e-5)
    # a query before the image: no value on any patch; a query inside it: the patches up to it
    view.set(query=a - 1)
    assert np.isnan(panel.grid_values).all() and view.shown[a][2] is None
    view.set(query=a + 5)
    vals = panel.grid_values.reshape(-1)
    np.testing.assert_allclose(vals[:6], ref[1, 3, a + 5, a: a + 6], atol=1e-5)
    assert np.isnan(vals[6:]).all()
    assert "[image 0 (1, 1)]" in view.view.caption
    html = view._repr_html_()
    assert 'class="image-attention"' in html


def test_attention_view_span_mass_with_images(vlm):
    from headlab.generation import tokenize
    from headlab.widgets import AttentionView

    ex = vlm_example()
    ex.spans["cat"] = [(4, 7)]
    batch = tokenize(vlm, [ex])
    ref = eager_attention(vlm, batch)
    view = AttentionView(vlm, example=ex, mode="query")
    s, e = view.token_spans["cat"][0]
    q = batch.length - 1
    np.testing.assert_allclose(view.span_mass().sel(span="cat").values, ref[:, :, q, s:e].sum(-1), atol=1e-5)


def test_report_of_a_vlm_run_draws_the_preview(vlm, tmp_path):
    from headlab.generation import tokenize
    from headlab.image_attention import attention_preview

    batch = tokenize(vlm, [vlm_example()])
    ref = eager_attention(vlm, batch)
    (a, b), = batch.image_spans[0]
    pre = attention_preview(vlm, batch)
    rng = np.random.default_rng(1)
    score = rng.random((3, 8))
    ds = xr.Dataset({"score": (("layer", "head"), score)}, coords={"layer": np.arange(3), "head": np.arange(8)},
                    attrs={"action": "detect", "method": "segment_divergence"}).merge(pre)
    spec = "name: vlm\nmodel: tiny\nsteps:\n  - id: vhd\n    detect: {kind: segment_divergence}\n"
    writer = RunWriter.create(tmp_path / "run", {"name": "vlm", "spec_text": spec, "status": "complete",
                                                 "sweep": {}, "steps": ["vhd"], "cells_total": 1})
    writer.write_cell("c0000", {}, {"vhd": ds}, {})
    html = render_report(open_run(tmp_path / "run"))
    svg = re.findall(r'<svg[^>]*class="image-attention".*?</svg>', html, flags=re.S)[0]
    layer, head = divmod(int(np.argmax(score)), 8)
    assert f"L{layer}H{head}" in svg
    rects = [a_ for t, a_ in tags(svg) if t == "rect" and a_.get("class") == "patch"]
    np.testing.assert_allclose([float(r["data-value"]) for r in rects], ref[layer, head, -1, a:b], rtol=1e-3)


@pytest.mark.parametrize("mode", ["pattern", "query"])
def test_attention_view_on_qwen2_vl_non_square_grid_and_multimodal_positions(mode):
    """Qwen2-VL: multimodal rotary positions, a grid that follows the image's aspect, no crop (the
    original image is what the grid covers)."""
    from headlab.generation import tokenize
    from headlab.image_attention import attention_preview, model_view
    from headlab.model import load_model
    from headlab.plugin_manager import get_manager
    from headlab.spec import ModelSpec
    from headlab.widgets import AttentionView

    if "headlab-tiny" not in get_manager().components["models"]:
        pytest.skip("the embedded model headlab-tiny (the tokenizer) is not in this checkout")
    lm = load_model(ModelSpec(config=dict(QWEN2_VL), device="cpu"))
    ex = vlm_example(PIL.fromarray(picture(32, 64)))
    batch = tokenize(lm, [ex])
    (a, b), = batch.image_spans[0]
    rows, cols = batch.image_grids[0][0]
    assert rows * cols == b - a and rows != cols and batch.position_ids is not None
    assert model_view(lm, batch, 0) is None
    ref = eager_attention(lm, batch)
    view = AttentionView(lm, example=ex, layer=1, head=6, mode=mode)
    q = batch.length - 1
    np.testing.assert_allclose(view.image_views[0].grid_values, ref[1, 6, q, a:b].reshape(rows, cols), atol=1e-5)
    assert view.image_views[0].aspect == pytest.approx(32 / 64)
    pre = attention_preview(lm, ex)
    np.testing.assert_allclose(pre[PREVIEW_ATTENTION].values, ref[:, :, q, a:b].reshape(3, 8, rows, cols), atol=1e-5)
    assert pre[PREVIEW_IMAGE].shape == (32, 64, 3)
