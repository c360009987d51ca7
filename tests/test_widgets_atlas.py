"""The atlas's notebook widget (headlab.widgets.AtlasMap): the stripes it draws are the cube's labels with the
report's shades, the hover text of every head lists every detector's score, label, rank and margin as the cube
holds them (formatted here from the cube), and hover and click reach Python callbacks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from headlab.role_figures import role_colours
from headlab.widgets import AtlasMap, hover_lines

from fixtures.figures import CHROMIUM, CHROMIUM_ARGS
from fixtures.role_cubes import DETECTORS, make_comparison, make_cube


@pytest.fixture(scope="module")
def cube():
    return make_cube(3, 5)


def test_stripes_are_the_labels_with_the_reports_shades(cube):
    view = AtlasMap(cube)
    names = list(cube["detector"].values)
    score, label = cube["score"].values, cube["label"].values
    biggest = np.nanmax(np.abs(score), axis=(1, 2))
    assert view.detectors == names and view.colours == list(role_colours(names).values())
    assert len(view.cells) == 3 and all(len(row) == 5 for row in view.cells)
    for la in range(3):
        for he in range(5):
            stripes = view.cells[la][he]
            assert [names[d] for d, _ in stripes] == [n for d, n in enumerate(names) if label[d, la, he]]
            for d, shade in stripes:
                assert shade == pytest.approx(min(1.0, score[d, la, he] / biggest[d]))
    assert any(len(c) > 1 for row in view.cells for c in row)


def test_hover_lists_every_detectors_score_label_rank_and_margin(cube):
    view = AtlasMap(cube)
    names = list(cube["detector"].values)
    for la in range(3):
        for he in range(5):
            text = view.tips[la][he]
            assert text == hover_lines(cube, la, he)
            lines = text.split("\n")
            roles = [n for n in names if bool(cube["label"].sel(detector=n, layer=la, head=he))]
            assert lines[0] == f"L{la}H{he}: " + (", ".join(roles) or "no role")
            for name, line in zip(names, lines[1:], strict=True):
                one = cube.sel(detector=name, layer=la, head=he)
                s, t = float(one["score"]), float(cube["threshold"].sel(detector=name))
                words = line.split()
                assert (line[0] == "✓") == bool(one["label"])
                assert name in words
                assert words[words.index("score") + 1] == ("nan" if np.isnan(s) else f"{s:.4g}")
                assert words[words.index("rank") + 1] == f"{int(one['rank'])}/15"
                margin = words[words.index("margin") + 1]
                assert margin == ("nan" if np.isnan(s) else ("+" if s >= t else "") + f"{s - t:.4g}")


def test_hover_and_click_call_back_and_cards(cube):
    view = AtlasMap(cube)
    hovered, selected = [], []
    view.on_hover(lambda la, he: hovered.append((la, he)))
    view.on_select(lambda la, he: selected.append((la, he)))
    view.hovered = [2, 4]  # what the view sets when the pointer enters a cell
    view.selected = [1, 3]  # what a click sets
    view.select(0, 1)
    assert hovered == [(2, 4)] and selected == [(1, 3), (0, 1)]
    card = view.card(2, 4)
    assert card["detectors"][DETECTORS[0]]["score"] == float(cube["score"].sel(detector=DETECTORS[0], layer=2, head=4))
    with pytest.raises(ValueError, match="labelled head cube"):
        AtlasMap(cube.drop_vars("label"))


def test_a_compared_cube_adds_the_grid_of_changes_and_the_differences_on_hover(cube):
    both = cube.merge(make_comparison(cube))
    names = list(cube["detector"].values)
    diff, change = both["score_diff"].values, both["label_change"].values
    assert (change > 0).any() and (change < 0).any()
    view = AtlasMap(both)
    assert AtlasMap(cube).changes == [] and view.cells == AtlasMap(cube).cells
    largest = np.abs(diff).max(axis=(1, 2))
    for la in range(3):
        for he in range(5):
            entries = view.changes[la][he]
            assert [d for d, _, _ in entries] == list(range(len(names)))
            for d, shade, c in entries:
                assert shade == pytest.approx(diff[d, la, he] / largest[d]) and c == change[d, la, he]
            lines = view.tips[la][he].split("\n")
            assert view.tips[la][he] == hover_lines(both, la, he)
            assert lines[0].startswith(f"L{la}H{he}: ")
            for d, (name, line) in enumerate(zip(names, lines[1:], strict=True)):
                words = line.split()
                assert name in words
                want = ("+" if diff[d, la, he] >= 0 else "") + f"{diff[d, la, he]:.4g}"
                assert words[words.index("diff") + 1] == want
                assert words[-1] == {1: "gained", -1: "lost"}.get(int(change[d, la, he]), want)
    assert f"{int((change > 0).sum())} gained, {int((change < 0).sum())} lost" in view.change_title
    assert AtlasMap(cube).change_chart() is None
    html = view._repr_html_()  # the static fallback: both grids
    assert html.startswith("<svg") and html.count("<svg") == 2 and "score difference" in html


def test_a_32_by_32_cube_keeps_its_cells_readable():
    view = AtlasMap(make_cube(32, 32, DETECTORS, seed=2, nan=False))
    assert view.cell_size == 15 and len(view.tips) == 32 and len(view.tips[0]) == 32


def _page(view: AtlasMap, tmp_path: Path) -> Path:
    """A page that renders the widget's own JavaScript (its ESM, as JupyterLab loads it) with a stand-in for the
    anywidget model holding the widget's synced state; ``window.sent`` collects what the view sends back."""
    names = ("detectors", "colours", "cells", "tips", "title", "hint", "cell_size", "hovered", "selected", "changes",
             "change_title")
    state = {name: getattr(view, name) for name in names}
    esm = json.dumps(view._esm).replace("<", "\\u003c")
    path = tmp_path / "page.html"
    path.write_text(f"""<!DOCTYPE html><html><head><meta charset="utf-8">
<style>{view._css}</style></head><body><div id="el"></div><script type="module">
const code = {esm};
const widget = (await import(URL.createObjectURL(new Blob([code], {{type: "text/javascript"}})))).default;
const state = {json.dumps(state)};
window.sent = [];
const model = {{get: k => state[k], set: (k, v) => {{ state[k] = v; window.sent.push([k, v]); }},
               on: () => {{}}, save_changes: () => {{}}}};
widget.render({{model, el: document.getElementById("el")}});
window.ready = true;
</script></body></html>""", encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} is missing (.ci/setup-test installs it)")
def test_the_view_draws_the_stripes_and_hover_shows_the_scores_in_chromium(cube, tmp_path):
    """The widget in headless chromium: a cell per head, a stripe per role, and entering a cell shows that head's
    hover text and sends ``hovered`` back; a click sends ``selected``; a compared cube adds the grid of changes,
    a stripe per detector with the gained and lost glyphs, whose cells hover the same text."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the notebook extras (playwright)")
    view = AtlasMap(cube)
    both = AtlasMap(cube.merge(make_comparison(cube)))
    (tmp_path / "both").mkdir()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(_page(view, tmp_path).as_uri())
            page.wait_for_function("() => window.ready === true", timeout=30000)
            assert page.locator(".ha-cell").count() == 15 and page.locator(".ha-changes").count() == 0
            for la in range(3):
                for he in range(5):
                    cell = page.locator(f'.ha-cell[data-layer="{la}"][data-head="{he}"]')
                    assert cell.locator(".ha-stripe").count() == len(view.cells[la][he])
                    assert cell.get_attribute("title") == view.tips[la][he]
            page.locator('.ha-cell[data-layer="2"][data-head="3"]').hover()
            assert page.locator(".ha-info").text_content() == view.tips[2][3]
            page.locator('.ha-cell[data-layer="1"][data-head="4"]').click()
            sent = page.evaluate("() => window.sent")
            page.goto(_page(both, tmp_path / "both").as_uri())
            page.wait_for_function("() => window.ready === true", timeout=30000)
            grid = page.locator(".ha-changes")
            assert grid.locator(".ha-cell").count() == 15
            for la in range(3):
                for he in range(5):
                    stripes = grid.locator(f'.ha-cell[data-layer="{la}"][data-head="{he}"] .ha-change')
                    assert stripes.count() == len(both.changes[la][he])
                    glyphs = ["▲" if c > 0 else "▼" if c < 0 else "" for _, _, c in both.changes[la][he]]
                    assert stripes.all_text_contents() == glyphs
            grid.locator('.ha-cell[data-layer="0"][data-head="2"]').hover()
            assert page.locator(".ha-info").text_content() == both.tips[0][2]
        finally:
            browser.close()
    assert not errors, errors
    assert ["hovered", [2, 3]] in sent and sent[-1] == ["selected", [1, 4]]
