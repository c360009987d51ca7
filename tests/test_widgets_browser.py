"""The widgets in a real browser: JupyterLab headless on localhost, the quickstart notebook opened in
Debian's chromium (driven by Playwright through its executable path), run top to bottom; the widgets
must render, respond to the mouse through the kernel, and nothing may be fetched from outside
localhost. A screenshot is saved (to ``$HEADLAB_ARTIFACTS`` when set, else the test's tmp dir).
The image attention view is checked the same way on a notebook written here (a tiny random LLaVA): a
click on a patch shows the attention value computed independently in the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]

if not Path(CHROMIUM).is_file():
    pytest.skip(f"{CHROMIUM} is missing and could not be installed (`apt-get install chromium`; .ci/setup-test does it)",
                allow_module_level=True)
playwright_sync = pytest.importorskip("playwright.sync_api", reason="needs the notebook extras (playwright)")
pytest.importorskip("jupyterlab", reason="needs the notebook extras (jupyterlab)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _embedded_model() -> str | None:
    from headlab.plugin_manager import get_manager

    if os.environ.get("HEADLAB_NOTEBOOK_MODEL"):
        return os.environ["HEADLAB_NOTEBOOK_MODEL"]
    return "headlab-tiny" if "headlab-tiny" in get_manager().components["models"] else None


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on 127.0.0.1 with a copy of the quickstart notebook; yields (url, token, dir)."""
    model = _embedded_model()
    if model is None:
        pytest.skip("the embedded model headlab-tiny is not in this checkout yet")
    work = tmp_path / "lab"
    work.mkdir()
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", work / "quickstart.ipynb")
    with _jupyterlab(tmp_path, work, model) as served:
        yield served


@contextlib.contextmanager
def _jupyterlab(tmp_path: Path, work: Path, model: str):
    """JupyterLab on 127.0.0.1 serving ``work``; yields (url, token, dir)."""
    config = tmp_path / "jupyter-config"
    (config / "labconfig").mkdir(parents=True)
    (config / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    # render every cell (no virtual scrolling), so the DOM holds every output
    settings = tmp_path / "lab-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"), "HEADLAB_NOTEBOOK_MODEL": model,
           "HEADLAB_NOTEBOOK_OUT": str(tmp_path / "runs"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "JUPYTER_PLATFORM_DIRS": "1"}
    log = (tmp_path / "lab.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", "--allow-root", "--ServerApp.terminals_enabled=False",
         "--LabApp.extension_manager=readonly", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.news_url=None"],
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            time.sleep(0.5)
        yield url, token, work
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextlib.contextmanager
def _browser(tmp_path: Path, url: str):
    """A headless chromium page (Debian's executable) and the list of requests it made outside ``url``."""
    outside: list[str] = []
    with playwright_sync.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000}, accept_downloads=False)
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.on("request", lambda r: None if r.url.startswith((url, "data:", "blob:", "about:"))
                    else outside.append(r.url))
            yield page, outside
        finally:
            context.close()


def _wait(page, js: str, timeout_s: float, what: str, tmp_path: Path):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = page.evaluate(js)
        if value:
            return value
        page.wait_for_timeout(250)
    page.screenshot(path=str(tmp_path / "timeout.png"), full_page=True)
    prompts = page.evaluate("() => [...document.querySelectorAll('.jp-InputPrompt')].map(p => p.textContent).join(' ')")
    pytest.fail(f"timed out waiting for {what}; prompts {prompts}; screenshot at {tmp_path / 'timeout.png'}")


def _run_notebook(page, url: str, token: str, name: str, tmp_path: Path) -> None:
    """Open notebook ``name`` in JupyterLab, run every cell, and check that none raised."""
    page.goto(f"{url}/lab/tree/{name}?token={token}", timeout=120_000)
    _wait(page, "() => !!(window.jupyterapp && document.querySelector('.jp-NotebookPanel .jp-Cell'))",
          120, "the notebook to open", tmp_path)
    _wait(page, """() => { const w = window.jupyterapp.shell.currentWidget;
               const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
               return !!k && k.connectionStatus === 'connected' && k.status === 'idle'; }""",
          120, "the kernel", tmp_path)
    page.evaluate("""() => { window.__headlabRun = null;
        window.jupyterapp.commands.execute('notebook:run-all-cells').then(
          r => window.__headlabRun = 'done', e => window.__headlabRun = 'error: ' + e); return true; }""")
    n_code = page.evaluate("() => document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell').length")
    _wait(page, f"""() => {{
        const prompts = [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt')]
          .map(p => p.textContent.trim());
        return prompts.length === {n_code} && prompts.every(p => /^\\[\\d+\\]:$/.test(p));
    }}""", 300, "every cell to run", tmp_path)
    tracebacks = page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']")
    assert tracebacks.count() == 0, tracebacks.first.text_content()[:2000]


@pytest.mark.slow  # JupyterLab and chromium: a process and a browser of their own, as the other browser tests
def test_quickstart_widgets_render_and_respond_in_jupyterlab(lab, tmp_path):
    url, token, work = lab
    artifacts = Path(os.environ.get("HEADLAB_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    with _browser(tmp_path, url) as (page, outside):
        _run_notebook(page, url, token, "quickstart.ipynb", tmp_path)

        # SpecRunner: finished, progress bars full, results rendered inside it
        runner = page.locator(".headlab-spec-runner").first
        assert "complete" in runner.locator(".headlab-run-status").text_content()
        assert runner.locator(".headlab-run-results .headlab-headmap").count() == 2
        bars = runner.locator(".widget-hprogress .progress-bar")
        assert bars.count() == 2
        assert "width: 100%" in (bars.first.get_attribute("style") or "")
        assert "progress-bar-success" in (bars.first.get_attribute("class") or "")
        # HeadMaps: one cell per head, top-3 selected, the spec fragment shown
        maps = page.locator(".jp-OutputArea-output .headlab-headmap")
        assert maps.count() >= 4
        hm = maps.nth(2)  # the "induction" map of section 3
        cells = hm.locator(".hl-cell")
        n_cells = cells.count()
        assert n_cells >= 4 and hm.locator(".hl-sel").count() == 3
        assert hm.locator(".hl-fragment").text_content().startswith("heads: [[")
        # hover shows the value; a click toggles the head in Python, whose fragment comes back
        target = hm.locator(".hl-cell:not(.hl-sel)").first
        layer, head = target.get_attribute("data-layer"), target.get_attribute("data-head")
        target.hover()
        assert hm.locator(".hl-tip").text_content().startswith(f"layer {layer}, head {head}: ")
        target.click()
        _wait(page, f"""() => {{ const m = document.querySelectorAll('.jp-OutputArea-output .headlab-headmap')[2];
            return m.querySelector('.hl-fragment').textContent.includes('[{layer}, {head}]')
                && m.querySelectorAll('.hl-sel').length === 4; }}""", 30, "the click to reach the kernel", tmp_path)
        # drag a 2x2 block from the top-left cell: the block joins the selection
        first = hm.locator('.hl-cell[data-layer="0"][data-head="0"]').bounding_box()
        last = hm.locator('.hl-cell[data-layer="1"][data-head="1"]').bounding_box()
        page.mouse.move(first["x"] + 4, first["y"] + 4)
        page.mouse.down()
        page.mouse.move(last["x"] + 4, last["y"] + 4, steps=4)
        page.mouse.up()
        _wait(page, """() => { const m = document.querySelectorAll('.jp-OutputArea-output .headlab-headmap')[2];
            const t = m.querySelector('.hl-fragment').textContent;
            return ['[0, 0]', '[0, 1]', '[1, 0]', '[1, 1]'].every(s => t.includes(s)); }""", 30,
              "the drag selection", tmp_path)
        # AttentionView: every token shown; clicking a token makes it the query (recomputed in Python)
        att = page.locator(".headlab-attention").first
        toks = att.locator(".hl-tok")
        assert toks.count() == 33 and att.locator(".hl-query").count() == 1
        toks.nth(10).click()
        _wait(page, """() => { const a = document.querySelector('.headlab-attention');
            return a.querySelector('.hl-caption').textContent.includes('query #10')
                && a.querySelector('.hl-query').dataset.pos === '10'
                && a.querySelectorAll('.hl-future').length === 22; }""", 30, "the query change", tmp_path)
        att.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts / "browser-attention.png"))
        # RunBrowser: lists the run
        assert page.locator(".headlab-run-browser table.hl-runs tbody tr").count() == 1
        # inline validation: a typo in the editor shows the located error under it
        editor = runner.locator("textarea")
        editor.fill(editor.input_value().replace("kind: induction", "kind: inductoin"))
        editor.press("Tab")  # the editor syncs on blur
        _wait(page, """() => { const e = document.querySelector('.headlab-spec-runner .headlab-spec-errors');
            return e && e.textContent.includes("unknown detector kind 'inductoin'")
                && !!e.querySelector('.hl-error-line'); }""", 30, "the inline error", tmp_path)
        runner.scroll_into_view_if_needed()
        shot = artifacts / "browser-quickstart.png"
        page.screenshot(path=str(shot), full_page=False)
        hm.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts / "browser-headmap.png"))
    assert not outside, f"requests left localhost: {outside[:5]}"
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    try:
        from PIL import Image

        img = Image.open(shot).convert("L")
        lo, hi = img.getextrema()
        assert hi - lo > 100  # not a blank page
    except ImportError:  # pragma: no cover - pillow comes with the notebook extras
        pass


VISION_CELLS = [
    """import numpy as np
from PIL import Image

from headlab.context import Example
from headlab.model import load_model
from headlab.spec import ModelSpec
from headlab.widgets import AttentionView

from fixtures.image_attention import LLAVA, PROMPT, picture

lm = load_model(ModelSpec(config=dict(LLAVA), device="cpu"))
example = Example(prompt=PROMPT, images=[Image.fromarray(picture(24, 32))])""",
    "view = AttentionView(lm, example=example, layer=2, head=5)\nview",
]


@pytest.mark.slow  # a JupyterLab and a Chromium of its own
def test_image_attention_view_click_shows_the_patch_value(tmp_path, monkeypatch):
    """AttentionView of a tiny random LLaVA: the image panel is drawn over the image; hovering a patch
    shows its value as a tooltip, clicking shows it under the image and, through the kernel, in the
    view's info; the value equals an eager-attention forward of the same model computed here."""
    nbformat = pytest.importorskip("nbformat")
    import numpy as np

    from headlab.generation import tokenize
    from headlab.model import load_model
    from headlab.plugin_manager import get_manager
    from headlab.spec import ModelSpec

    from fixtures.image_attention import LLAVA, eager_attention, vlm_example

    if "headlab-tiny" not in get_manager().components["models"]:
        pytest.skip("the embedded model headlab-tiny (the tokenizer) is not in this checkout yet")
    lm = load_model(ModelSpec(config=dict(LLAVA), device="cpu"))  # the same seed as the notebook's
    batch = tokenize(lm, [vlm_example()])
    (a, b), = batch.image_spans[0]
    rows, cols = batch.image_grids[0][0]
    ref = eager_attention(lm, batch)[2, 5, batch.length - 1, a:b]
    patch = int(np.argmax(ref))  # the most attended patch: a value well above rounding
    expected = float(ref[patch])

    work = tmp_path / "lab"
    work.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in VISION_CELLS], metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}})
    nbformat.write(nb, work / "vision.ipynb")
    artifacts = Path(os.environ.get("HEADLAB_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    env_path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests") + (os.pathsep + env_path if env_path else ""))  # fixtures.*
    with _jupyterlab(tmp_path, work, "headlab-tiny") as (url, token, _), _browser(tmp_path, url) as (page, outside):
        _run_notebook(page, url, token, "vision.ipynb", tmp_path)
        panel = page.locator(".headlab-image-attention").first
        _wait(page, "() => !!document.querySelector('.headlab-image-attention .hl-patch')", 60,
              "the image panel", tmp_path)
        assert panel.locator(".hl-patch").count() == rows * cols
        assert panel.locator("img.hl-image").get_attribute("src").startswith("data:image/png;base64,")
        assert panel.locator(".hl-colourbar .hl-gradient").count() == 1
        chips = page.locator(".headlab-attention .hl-image-chip")
        assert chips.count() == 1 and chips.first.text_content() == f"[image {rows} x {cols}]"
        cell = panel.locator(f'.hl-patch[data-index="{patch}"]')
        r, c = divmod(patch, cols)
        assert (cell.get_attribute("data-row"), cell.get_attribute("data-col"),
                cell.get_attribute("data-token")) == (str(r), str(c), str(a + patch))
        cell.hover()
        tip = panel.locator(".hl-tip").text_content()
        assert tip.startswith(f"row {r}, col {c}, token #{a + patch}: ")
        assert abs(float(tip.rsplit(": ", 1)[1]) - expected) <= 1e-3 * abs(expected) + 1e-7
        cell.click()
        info = panel.locator(".hl-patch-info").text_content()
        assert info.startswith(f"row {r}, col {c}, token #{a + patch}: ")
        assert abs(float(info.rsplit(": ", 1)[1]) - expected) <= 1e-3 * abs(expected) + 1e-7
        # the click reached Python, which shows the value it computed
        shown = _wait(page, """() => { const e = document.querySelector('.hl-selected-patch');
            return e ? e.textContent : ''; }""", 30, "the click to reach the kernel", tmp_path)
        assert f"token #{a + patch}: " in shown
        assert abs(float(shown.rsplit(": ", 1)[1]) - expected) < 1e-5
        assert panel.locator(".hl-patch.hl-selected").get_attribute("data-index") == str(patch)
        panel.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts / "browser-image-attention.png"))
    assert not outside, f"requests left localhost: {outside[:5]}"


PATCHING_CELLS = [
    """import numpy as np
import xarray as xr

from headlab.widgets import PatchingMap

score = np.zeros((2, 3, 4))
score[0, 1] = [0.0, 0.1, 0.6, 0.2]
score[1, 2] = [0.0, 0.3, 0.1, -0.8]
ds = xr.Dataset({"score": (("layer", "head", "token"), score), "clean": (("example",), [2.0]),
                 "corrupt": (("example",), [-1.0])}, attrs={"method": "activation_patching"})""",
    'view = PatchingMap(ds, tokens=["<bos>", "a", "b", ":"])\nview',
]


@pytest.mark.slow  # a JupyterLab and a Chromium of its own
def test_patching_map_click_shows_scores_per_token(tmp_path):
    """PatchingMap in JupyterLab: a click on a head's cell goes through the kernel and comes back as that
    head's scores per token under the map (values of the dataset written in the notebook)."""
    nbformat = pytest.importorskip("nbformat")
    work = tmp_path / "lab"
    work.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in PATCHING_CELLS], metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}})
    nbformat.write(nb, work / "patching.ipynb")
    artifacts = Path(os.environ.get("HEADLAB_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    with _jupyterlab(tmp_path, work, "headlab-tiny") as (url, token, _), _browser(tmp_path, url) as (page, outside):
        _run_notebook(page, url, token, "patching.ipynb", tmp_path)
        _wait(page, "() => document.querySelectorAll('.headlab-patching .hl-cell').length === 6", 60,
              "the patching map", tmp_path)
        root = page.locator(".headlab-patching").first
        assert "Click a head" in root.text_content()
        cell = root.locator('.hl-cell[data-layer="1"][data-head="2"]')
        assert cell.get_attribute("data-value") == "-0.8000"  # the peak over tokens
        cell.click()
        # the panel comes back as the report's token heatmap (headlab.circuit_figures.token_chart), as SVG
        marks = '.headlab-patching-tokens [aria-roledescription="rect mark"]'
        _wait(page, f"() => document.querySelectorAll('{marks}').length === 4", 30,
              "the click to reach the kernel and the panel to come back", tmp_path)
        labels = page.evaluate(f"() => [...document.querySelectorAll('{marks}')].map(r => r.getAttribute('aria-label'))")
        cells = [dict(part.split(": ", 1) for part in label.split("; ")) for label in labels]
        assert [(c["head"], c["token"], float(c["score"].replace("\u2212", "-"))) for c in cells] == \
            [("L1H2", t, v) for t, v in zip(["<bos>", "a", "b", ":"], [0.0, 0.3, 0.1, -0.8], strict=True)]
        root.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts / "browser-patching.png"))
    assert not outside, f"requests left localhost: {outside[:5]}"
