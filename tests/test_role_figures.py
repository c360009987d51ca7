"""The figures and rows of a labelled head cube (headlab.roles, headlab.role_figures): every value a figure's
Vega-Lite data carries is checked against the cube, recomputed here with numpy (roles from the labels, top heads
by sorting the scores, margins, null z, the random draws' mean and 95% range, gained and lost heads)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from headlab import figures, role_figures, roles

from fixtures.figures import rows as data_rows
from fixtures.role_cubes import DETECTORS, make_comparison, make_cube


def _rows(chart) -> list[dict]:
    spec = figures.figure_spec(chart)
    return spec["data"]["values"] if "values" in spec.get("data", {}) else data_rows(spec)


def _same(a, b) -> bool:
    return (a is None and (b is None or not math.isfinite(b))) or (a is not None and a == pytest.approx(b))


@pytest.fixture(scope="module")
def cube():
    return make_cube()


def test_roles_by_head_are_the_labels_and_several_roles_show_as_stripes(cube):
    score, label = cube["score"].values, cube["label"].values
    names = list(cube["detector"].values)
    by_head = roles.roles_by_head(cube)
    assert len(by_head) == cube.sizes["layer"] * cube.sizes["head"]
    for (la, he), rs in by_head.items():
        assert rs == [names[d] for d in range(len(names)) if label[d, la, he]]
    assert any(len(rs) >= 2 for rs in by_head.values()), "the fixture must have a head with several roles"
    chart = role_figures.role_grid_chart(cube)
    data = _rows(chart)
    assert data == role_figures.grid_rows(cube)
    biggest = np.nanmax(np.abs(score), axis=(1, 2))
    for (la, he), rs in by_head.items():
        stripes = sorted((r for r in data if r["layer"] == la and r["head"] == he), key=lambda r: r["x0"])
        if not rs:
            assert [(r["role"], r["x0"], r["x1"]) for r in stripes] == [(None, he, he + 1)]
            continue
        assert [r["role"] for r in stripes] == rs
        assert stripes[0]["x0"] == he and stripes[-1]["x1"] == pytest.approx(he + 1)
        assert all(a["x1"] == pytest.approx(b["x0"]) for a, b in zip(stripes, stripes[1:], strict=False))
        for r in stripes:
            d = names.index(r["role"])
            assert r["score"] == score[d, la, he]
            assert r["shade"] == pytest.approx(min(1.0, score[d, la, he] / biggest[d]))
        for d, name in enumerate(names):  # the tooltip lists every detector's score, labelled ones ticked
            text = f"{name} {'nan' if np.isnan(score[d, la, he]) else format(score[d, la, he], '.3g')}"
            assert text + (" ✓" if label[d, la, he] else "") in stripes[0]["scores"].split("; ")


def test_grid_reads_at_32_by_32():
    big = make_cube(32, 32, DETECTORS[:3], seed=3)
    assert role_figures.cell_size(32, 32) == 14 and role_figures.cell_size(4, 6) == 24
    spec = figures.figure_spec(role_figures.role_grid_chart(big), validate=False)
    assert (spec["width"], spec["height"]) == (14 * 32, 14 * 32)
    x_ticks = spec["layer"][0]["encoding"]["x"]["axis"]["values"]
    assert len(x_ticks) == 16 and x_ticks[:2] == [0.5, 2.5]
    panels = figures.figure_spec(role_figures.role_panels_chart(big), validate=False)
    assert panels["columns"] == 3 and len(panels["data"]["values"]) == 3 * 32 * 32


def test_panels_carry_every_score_label_and_rank(cube):
    data = _rows(role_figures.role_panels_chart(cube))
    assert len(data) == cube["score"].size
    for r in data:
        one = cube.sel(detector=r["detector"], layer=r["layer"], head=r["head"])
        assert _same(r["score"], float(one["score"]))
        assert r["label"] == bool(one["label"]) and r["rank"] == int(one["rank"])
        assert r["threshold"] == float(cube["threshold"].sel(detector=r["detector"]))
        n = int(cube["label"].sel(detector=r["detector"]).sum())
        assert r["panel"].startswith(f"{r['detector']}: {n} labelled")


def test_signed_scores_get_a_diverging_scale():
    spec = figures.figure_spec(role_figures.role_panels_chart(make_cube(signed=True)))
    scale = spec["spec"]["layer"][1]["encoding"]["color"]["scale"]
    assert scale["domain"] == [-1, 1] and scale["domainMid"] == 0


def test_top_heads_sorted_with_margin_and_null_z(cube):
    k = 3
    got = roles.top_heads(cube, k)
    assert len(got) == k * cube.sizes["detector"]
    for d, name in enumerate(cube["detector"].values):
        s = cube["score"].values[d].ravel()
        order = np.argsort(np.where(np.isnan(s), -np.inf, s))[::-1][:k]
        mine = [r for r in got if r["detector"] == name]
        assert [(r["layer"], r["head"]) for r in mine] == [divmod(int(i), cube.sizes["head"]) for i in order]
        assert [r["rank"] for r in mine] == [1, 2, 3]
        t, mu, sd = (float(cube[v].values[d]) for v in ("threshold", "null_mean", "null_std"))
        for r in mine:
            assert r["score"] == pytest.approx(s[r["layer"] * cube.sizes["head"] + r["head"]])
            assert r["margin"] == pytest.approx(r["score"] - t)
            assert r["null_z"] == pytest.approx((r["score"] - mu) / sd)
            assert r["label"] == (r["score"] >= t)
            assert r["threshold_source"] == str(cube["threshold_source"].values[d])


def test_head_card_has_every_detector(cube):
    card = roles.head_card(cube, 2, 3)
    assert card["roles"] == roles.roles_by_head(cube)[(2, 3)]
    for name, entry in card["detectors"].items():
        one = cube.sel(detector=name, layer=2, head=3)
        assert entry == {"score": float(one["score"]), "label": bool(one["label"]), "rank": int(one["rank"]),
                         "threshold": float(cube["threshold"].sel(detector=name)),
                         "margin": pytest.approx(float(one["score"]) - float(cube["threshold"].sel(detector=name)))}
    assert roles.head_cards(cube)[2 * cube.sizes["head"] + 3] == card
    assert roles.head_card(cube, 1, 2)["detectors"][DETECTORS[0]]["score"] is None  # NaN


def test_causal_bars_against_the_draws_and_not_supported_in_words(cube):
    data = _rows(role_figures.causal_chart(cube))
    names = list(cube["detector"].values)
    for d, name in enumerate(names[:-1]):
        draws = cube["control_effect"].values[d]
        top = next(r for r in data if r["bar"] == f"{name}: top 3 labelled")
        ctrl = next(r for r in data if r["bar"] == f"{name}: random")
        assert top["role"] == ctrl["role"] == f"{name} (repeat_loss)"
        assert top["_v"] == pytest.approx(float(cube["effect"].values[d])) and not top["control"]
        mean, std = draws.mean(), draws.std(ddof=1)
        assert ctrl["_v"] == pytest.approx(mean) and ctrl["control"]
        assert (ctrl["_lo"], ctrl["_hi"]) == pytest.approx((mean - 2 * std, mean + 2 * std))
        supported = bool(cube["supported"].values[d])
        assert top["note"] == ("supported" if supported else "NOT supported")
        sentence = roles.causal_sentence(next(r for r in roles.causal_rows(cube) if r["detector"] == name))
        assert ("not supported" in sentence) == (not supported)
        assert f"over {draws.size} draws" in sentence and "top 3 labelled heads" in sentence
    assert not any(r["bar"].startswith(names[-1]) for r in data)  # not measured: no bar, its status in words
    last = next(r for r in roles.causal_rows(cube) if r["detector"] == names[-1])
    assert roles.causal_sentence(last) == f"{names[-1]}: no causal metric."


def test_comparison_changes_and_rank_correlation(cube):
    cmp = make_comparison(cube)
    change = cmp["label_change"].values
    assert (change == 1).any() and (change == -1).any()
    data = _rows(role_figures.change_grid_chart(cmp))
    assert len(data) == cmp["score_diff"].size
    for r in data:
        one = cmp.sel(detector=r["detector"], layer=r["layer"], head=r["head"])
        assert r["score_diff"] == pytest.approx(float(one["score_diff"]))
        assert r["change"] == {1: "gained", -1: "lost", 0: None}[int(one["label_change"])]
    for row in roles.changed_heads(cmp):
        d = list(cmp["detector"].values).index(row["detector"])
        for key, sign in (("gained", 1), ("lost", -1)):
            assert sorted((la, he) for la, he, _ in row[key]) == sorted(
                (int(a), int(b)) for a, b in zip(*np.nonzero(change[d] == sign), strict=True))
    bars = _rows(role_figures.rank_correlation_chart(cmp))
    assert [b["_v"] for b in bars] == pytest.approx(cmp["rank_correlation"].values.tolist())


def test_cube_parts_in_report_order(cube):
    both = cube.merge(make_comparison(cube))
    parts = role_figures.cube_parts(both, "atlas", top=2)
    assert [p.name for p in parts if p.chart is not None] == [
        "atlas: roles", "atlas: score per detector", "atlas: causal check", "atlas: changes",
        "atlas: rank correlation"]
    table = next(p for p in parts if p.header and p.header[0] == "detector" and "margin" in p.header)
    assert len(table.rows) == 2 * cube.sizes["detector"]
    assert [p.text.split(":")[0] for p in parts if p.text] == list(cube["detector"].values)
    assert role_figures.cube_parts(cube.drop_vars(["effect", "control_effect", "supported"]))[-1].header
    assert not roles.is_cube(make_comparison(cube)) and roles.is_cube_comparison(both)
