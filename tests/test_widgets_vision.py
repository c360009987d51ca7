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


def picture(h: int = 12, w: int = 20) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([(x * 12) % 256, (y * 20) % 256, (x * y) % 256], axis=-1).astype(np.uint8)


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
    assert "image-attention" not in html and "attention over the image" not in html and "L0" in html
