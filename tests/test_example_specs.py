"""Every example spec in specs/ runs through the command line as the README shows it, ``headlab show`` and
``headlab report`` read each run, and the figures the README quotes are what the run stores.

The commands run in a scratch directory holding ``specs`` (a link to the repository's), so they are typed
exactly as in the README (``headlab run specs/quickstart.yaml``) and their ``./headlab-runs`` stays out of
the checkout. Every spec but the quickstart is marked slow: `.ci/run` (CI) runs the slow set after the
default one, so each still gates a landing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import headlab
from headlab.heads import ranked

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
HEADLAB = Path(sys.executable).parent / "headlab"  # the console script the README's commands call
FAST = ["quickstart"]
SLOW = ["retrieval_heads", "pasta_emphasis", "decoding_counterfact", "vhr_shapes", "kv_compression", "probes",
        "probes_iti", "head_importance", "circuits"]


def test_every_example_spec_is_covered():
    assert sorted(FAST + SLOW) == sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("readme")
    (d / "specs").symlink_to(ROOT / "specs")
    return d


def typed(command: str, cwd: Path, timeout: float = 1200) -> subprocess.CompletedProcess:
    """A README command line, as a user types it (``headlab`` is the installed console script)."""
    args = command.split()
    assert args[0] in ("headlab", ".venv/bin/headlab"), command
    res = subprocess.run([str(HEADLAB), *args[1:]], capture_output=True, text=True, cwd=cwd, timeout=timeout)
    assert res.returncode == 0, f"{command}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr and "error:" not in res.stderr, res.stderr
    return res


def run_spec(name: str, workdir: Path, timeout: float = 1200) -> headlab.Run:
    """``headlab run specs/NAME.yaml``, then ``headlab show`` and ``headlab report`` of the run it stored."""
    runs = workdir / "headlab-runs"
    before = set(runs.iterdir()) if runs.exists() else set()
    res = typed(f"headlab run specs/{name}.yaml", workdir, timeout)
    (path,) = set(runs.iterdir()) - before
    assert path.name in res.stdout
    shown = typed(f"headlab show {path}", workdir)
    assert "complete" in shown.stdout
    typed(f"headlab report {path} -o {workdir / (name + '.html')}", workdir)
    assert (workdir / f"{name}.html").stat().st_size > 1000
    run = headlab.open_run(path)
    assert run.status == "complete" and run.cells_done == run.cells_total
    return run


def report_in_browser(name: str, workdir: Path, expected: list[str] | None = None) -> None:
    """The report ``run_spec`` wrote, rendered in headless chromium: no console errors, the expected figures
    (``expected``, else the spec's entry in REPORT_FIGURES) drawn, axes titled, tick labels inside
    (tests/test_report_browser.py does the same on small runs)."""
    from fixtures.figures import CHROMIUM, assert_renders
    from fixtures.report_runs import REPORT_FIGURES

    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} is missing (.ci/setup-test installs it)")
    assert_renders(workdir / f"{name}.html", REPORT_FIGURES[name] if expected is None else expected,
                   workdir / f"{name}-chromium-profile")


def readme_number(pattern: str) -> float:
    m = re.search(pattern, README)
    assert m, f"the README no longer says {pattern!r}"
    return float(m.group(1))


# --------------------------------------------------------------------------- fast: the default test run
def test_quickstart_as_typed(workdir):
    assert ".venv/bin/headlab run specs/quickstart.yaml" in README
    run = run_spec("quickstart", workdir)
    table = README[README.index("previous_token (mul)"):]
    rows = [line.split() for line in table.splitlines()[2:6]]
    prev = run.results["previous"]["score"].mean("task.length")
    ind = run.results["induction"]["score"].mean("task.length")
    for row in rows:  # "layer head score  layer head score", rounded as the README prints them
        (pl, ph, ps, il, ih, isc) = row
        assert round(float(prev.sel(layer=int(pl), head=int(ph))), 2) == float(ps)
        assert round(float(ind.sel(layer=int(il), head=int(ih))), 2) == float(isc)
    assert [h for h, _ in ranked(prev)[:4]] == [(int(r[0]), int(r[1])) for r in rows]  # the top four, in order


@pytest.mark.slow  # the same spec as test_quickstart_as_typed, from Python
def test_quickstart_from_python_as_typed(workdir):
    block = README[README.index("The same from Python:"):]
    code = block[block.index("```python") + len("```python"):block.index("```", block.index("```python") + 9)]
    code += "\nassert score.dims == ('task.length', 'layer', 'head'), score.dims\nprint(run.status)\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=workdir, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("complete")


@pytest.mark.slow
def test_retrieval_heads_causal_check_as_typed(workdir):
    run = run_spec("retrieval_heads", workdir)
    score = run.results["retrieval"]["score"]
    n_ret = int((score >= 0.1).sum())
    assert f"{n_ret} of {score.size} heads are retrieval heads" in README
    abl = run.results["ablation"]
    top, rnd = abl["top"], abl["random"].mean("draw")
    assert round(float(top.sel(k=4)), 2) == readme_number(r"masking the 4 top retrieval heads takes needle recall "
                                                          r"from 1.00 to ([0-9.]+)")
    assert round(float(top.sel(k=n_ret)), 2) == readme_number(r"\(all 7: ([0-9.]+)\)")
    assert round(float(rnd.sel(k=4)), 2) == readme_number(r"4 random heads keep ([0-9.]+)")
    assert float(abl["base"]) == 1.0
    shown = typed(f"headlab show {run.path} --steps", workdir).stdout
    for metric, value in (("base", "1.0000"), ("top", "0.0889"), ("random", "1.0000")):  # a row per k, no mean over k
        assert re.search(rf"│ 4 +│ {metric} +│ {re.escape(value)} │", shown), shown
    # the paper's findings (docs/detectors.md): a small fraction of heads retrieve, masking the top ones collapses
    # recall, random ones keep it; at k = all, random draws that hit a few early-layer heads fall too on this
    # 32-head model (CHANGELOG.md: 0.98 0.98 0.53 0.78 0.96), so only the median draw is asserted
    ret = run.results["retrieval"]
    n_heads = int(ret["retrieval_head"].sum())
    assert 0 < n_heads <= 0.25 * score.size and ret["retrieved"].values.mean() >= 0.9
    for k in (4, n_heads):
        assert float(top.sel(k=k)) <= 0.2, f"masking the top {k} retrieval heads collapses recall"
    assert float(abl["random"].sel(k=4).min()) >= 0.8, "masking 4 random heads keeps recall (every draw)"
    assert float(abl["random"].sel(k=n_heads).median()) >= 0.8


def readme_row(spec: str) -> str:
    line = next((line for line in README.splitlines() if line.startswith(f"| `specs/{spec}.yaml`")), None)
    assert line, f"the README's table of example specs has no row for {spec}"
    return line


@pytest.mark.slow
def test_pasta_emphasis_as_typed(workdir):
    run = run_spec("pasta_emphasis", workdir)
    row = readme_row("pasta_emphasis")
    plain, pasta, control = (float(x) for x in re.search(r"\(([0-9.]+) -> ([0-9.]+)\); 4 random heads do not "
                                                          r"\(([0-9.]+)\)", row).groups())
    answer = {step: round(float(run.results[step]["any_answer"].mean()), 2)
              for step in ("markers", "pasta", "pasta_random")}
    assert answer == {"markers": plain, "pasta": pasta, "pasta_random": control}
    # docs/steering.md: PASTA beats the three unsteered variants by at least 0.2, and the profiled heads beat
    # random ones
    acc = {k: float(run.results[k]["any_answer"].mean()) for k in ("baseline", "plain_text", "markers", "pasta")}
    assert all(acc["pasta"] >= acc[k] + 0.2 for k in ("baseline", "plain_text", "markers")), acc
    assert acc["pasta"] > float(run.results["pasta_random"]["any_answer"].mean())
    prof = run.results["profile"]
    assert 0 < int(prof["selected"].sum()) < prof["selected"].size


@pytest.mark.slow
def test_decoding_counterfact_as_typed(workdir):
    """The README quotes the fraction of examples answered with the context's capital (``context_memory`` is
    1 for it, 0 for the memorised one, NaN for neither)."""
    run = run_spec("decoding_counterfact", workdir)
    row = readme_row("decoding_counterfact")
    quoted = {step: float(re.search(rf"{label} \(([0-9.]+)\)", row).group(1)) for step, label in
              [("decore", "DeCoRe"), ("cad", "CAD"), ("greedy", "greedy"), ("decore_random", "does not")]}
    context = {step: round(float((run.results[step]["context_memory"] == 1).mean()), 2) for step in quoted}
    assert context == quoted
    rate = {step: float(np.mean(run.results[step]["context_memory"].values == 1.0)) for step in quoted}
    assert rate["decore"] > rate["greedy"] and rate["cad"] > rate["greedy"], rate  # docs/decoding.md's orderings
    assert rate["decore"] > rate["decore_random"], rate
    report_in_browser("decoding_counterfact", workdir)


@pytest.mark.slow
def test_head_importance_as_typed(workdir):
    """The README quotes the pruning curves at one fraction each: the ranked curve, the unmasked recall, the random
    control's mean and the reverse ranking."""
    run = run_spec("head_importance", workdir)
    row = readme_row("head_importance")
    grad = re.search(r"keeps recall at ([0-9.]+) \(unmasked: ([0-9.]+)\), a random quarter leaves ([0-9.]+) \(mean of "
                     r"3 draws\) and the top quarter ([0-9.]+)", row).groups()
    ships = re.search(r"by Ships keeps ([0-9.]+), random ([0-9.]+), the top 37.5% ([0-9.]+)", row).groups()
    for step, fraction, quoted in (("curve", 0.25, grad), ("curve_ships", 0.375, (ships[0], grad[1], *ships[1:]))):
        ds = run.results[step].sel(fraction=fraction)
        got = [ds["metric"], ds["base"], ds["random_mean"], ds["reverse"]]
        assert [round(float(v), 2) for v in got] == [float(q) for q in quoted], step
    assert run.results["imp"].attrs["abs"] == "per_example" and "kl" not in run.results["ships"]
    report_in_browser("head_importance", workdir, ["curve: masking curve", "curve_ships: masking curve"])


# --------------------------------------------------------------------------- slow
@pytest.mark.slow
def test_vhr_shapes_as_typed(workdir):
    run = run_spec("vhr_shapes", workdir)
    row = readme_row("vhr_shapes")
    greedy, vhr = (float(x) for x in re.search(r"CHAIR_s ([0-9.]+) -> ([0-9.]+)", row).groups())
    chair = {step: float(ds["chair_s"].mean()) for step, ds in run.results.items() if "chair_s" in ds}
    assert (round(chair["greedy"], 2), round(chair["vhr"], 2)) == (greedy, vhr)
    random_mean = np.mean([chair[f"random_heads_{k}"] for k in range(5)])
    layer_mean = np.mean([chair[f"layer_random_{k}"] for k in range(5)])
    assert round(random_mean, 2) == float(re.search(r"8 random heads do not \(([0-9.]+) on average\)", row).group(1))
    assert round(layer_mean, 2) == float(re.search(r"VHR's own layers do \(([0-9.]+)\)", row).group(1))
    pope = re.search(r"POPE accuracy \(([0-9.]+) -> ([0-9.]+)\)", row).groups()
    acc = tuple(round(float(run.results[s]["pope"].mean()), 2) for s in ("pope_greedy", "pope_vhr"))  # accuracy
    assert acc == tuple(float(x) for x in pope)
    # docs/steering.md: VHR at the validation-selected setting names fewer absent objects than greedy without
    # naming fewer present ones, and 8 random heads scaled by the same factor do not lower it as much
    assert chair["vhr"] <= chair["greedy"] - 0.1 and random_mean >= chair["vhr"] + 0.08, chair
    mentions = {s: float(run.results[s]["chair_mentions"].mean()) for s in ("vhr", "greedy")}
    assert mentions["vhr"] >= mentions["greedy"] - 0.2, mentions
    selected = run.results["vhr"]["vhr_selected"]
    assert set(int(ly) for ly in selected["layer"][selected.any(["example", "head"])].values) == {0, 3}


@pytest.mark.slow
def test_kv_compression_as_typed(workdir):
    """Every step with a KV policy is measured and shown; the random control holds the same bytes as the
    streaming step it matches and recalls less (docs/kv.md)."""
    run = run_spec("kv_compression", workdir, timeout=2400)  # about 5 min on 2 cores shared with other jobs
    res = run.results
    steps = [s for s in res if s != "retrieval"]
    assert len(steps) == 12 and all("kv_kept_fraction" in res[s] for s in steps)
    shown = typed(f"headlab show {run.path} --steps", workdir).stdout
    for s in steps:
        assert f"{s}: kv {res[s].attrs['kv_policy']} kept fraction {res[s].attrs['kv_kept_fraction']:.4f}" in shown
    assert res["full"].attrs["kv_kept_fraction"] == 1.0
    assert res["full"]["needle_recall"].size == 45  # 3 lengths x 5 depths x 3 needles
    for window in (128, 256):
        stream, rand = res[f"streaming_top4_w{window}"], res[f"random_top4_w{window}"]
        assert int(stream["kv_full"].sum()) == int(rand["kv_full"].sum()) == 4
        assert stream.attrs["kv_kept_fraction"] == pytest.approx(rand.attrs["kv_kept_fraction"], rel=1e-3)
    assert float(res["streaming_top4_w128"]["needle_recall"].mean()) > float(res["random_top4_w128"]["needle_recall"].mean())
    # the figures the README quotes (greedy decoding: deterministic on a CPU)
    def recall(step: str, length: int) -> float:
        ds = res[step]
        return float(ds["needle_recall"].where(ds["context_length"] == length, drop=True).mean())
    assert res["streaming_top4_w128"].attrs["kv_kept_fraction"] == pytest.approx(0.30, abs=0.005)
    assert (recall("streaming_top4_w128", 1024), recall("streaming_top4_w128", 2048)) == pytest.approx((0.93, 0.80), abs=0.01)
    assert (recall("full", 1024), recall("full", 2048)) == pytest.approx((1.00, 0.93), abs=0.01)
    assert float(res["random_top4_w128"]["needle_recall"].mean()) == pytest.approx(0.20, abs=0.01)
    # headkv at the kept fractions of the window-128 streaming steps, met at the longest prompt (+ new tokens)
    longest = int(res["full"]["kv_full"].attrs["length"])
    for step, stream in (("headkv_f018", "streaming_top2_w128"), ("headkv_f030", "streaming_top4_w128"),
                         ("headkv_f053", "streaming_top8_w128")):
        ds, budget = res[step], round(res[stream].attrs["kv_kept_fraction"], 2)
        heads = ds["kv_full"].attrs
        assert heads["budget"] == f"fraction {budget}" and heads["budget_length"] == heads["length"] == longest
        assert heads["budget_tokens_per_head"] == int(budget * longest)
        # at most the budget: a KV head whose share exceeds the prompt keeps the prompt, the surplus is lost
        assert 0 < heads["kept_fraction"] <= budget + 0.001
        assert {(3, h) for h in range(4)} >= set(map(tuple, np.argwhere(ds["kv_full"].values).tolist()))
        assert ds["needle_recall"].size == 45 and np.isfinite(ds["needle_recall"].values).all()
        # the shorter batches keep a larger share of their prompts than the longest one
        assert heads["kept_fraction"] < ds.attrs["kv_kept_fraction"] < heads["kept_fraction"] + 0.1
        # full attention in the prefill, as `full`: all of the shortest prompts, no more than `full` at the longest
        assert recall(step, 1024) == 1.0 and recall(step, 3072) <= recall("full", 3072)
    assert res["headkv_f018"]["kv_full"].attrs["full_kv_heads"] == 0  # no head capped: the budget, to the rounding
    assert res["headkv_f018"]["kv_full"].attrs["kept_fraction"] == pytest.approx(0.18, abs=0.001)
    kept = [res[f"headkv_f0{b}"].attrs["kv_kept_fraction"] for b in (18, 30, 53)]
    assert kept == sorted(kept)
    quoted = re.search(r"HeadKV's per-head budgets at a fraction of 0.30 hold ([0-9.]+) and recall ([0-9.]+) / ([0-9.]+)",
                       README)
    assert quoted, "the README no longer quotes headkv_f030"
    assert res["headkv_f030"].attrs["kv_kept_fraction"] == pytest.approx(float(quoted.group(1)), abs=0.005)
    assert (recall("headkv_f030", 1024), recall("headkv_f030", 2048)) == pytest.approx(
        (float(quoted.group(2)), float(quoted.group(3))), abs=0.01)
    assert float(res["headkv_f030"]["needle_recall"].mean()) > float(res["random_top4_w128"]["needle_recall"].mean()) + 0.3
    html = (workdir / "kv_compression.html").read_text()
    assert 'id="kv"' in html and "needle_recall vs kept fraction of the full KV cache" in html
    report_in_browser("kv_compression", workdir)


@pytest.mark.slow
def test_probes_iti_as_typed(workdir):
    """The README quotes the context rate (``context_memory`` averaged over the answers naming either capital)
    of each step and how many of ITI's answers name neither."""
    run = run_spec("probes_iti", workdir)
    row = readme_row("probes_iti")
    greedy, iti, neither, heads, direction = re.search(
        r"from ([0-9.]+) to ([0-9.]+) \(([0-9]+) of 48 answers name neither capital\); 4 random heads do not "
        r"\(([0-9.]+)\), nor random directions on the top heads \(([0-9.]+)\)", row).groups()
    rate = {step: round(float(np.nanmean(run.results[step]["context_memory"].values)), 2)
            for step in ("greedy", "iti", "iti_random_heads", "iti_random_dir")}
    assert rate == {"greedy": float(greedy), "iti": float(iti), "iti_random_heads": float(heads),
                    "iti_random_dir": float(direction)}
    assert int(np.isnan(run.results["iti"]["context_memory"].values).sum()) == int(neither)


@pytest.mark.slow
def test_probes_as_typed(workdir):
    """The probe and sav steps of specs/probes.yaml, and the figures docs/probes.md and the README quote."""
    run = run_spec("probes", workdir)
    res = run.results
    doc = (ROOT / "docs" / "probes.md").read_text(encoding="utf-8")
    for step, name in (("pr", "logistic"), ("means", "nearest mean")):
        row = doc[doc.index(f"| `{step}` ({name}) |"):].splitlines()[0]
        layer, head, best = re.search(r"best head \((\d), (\d)\) at ([0-9.]+)", row).groups()
        score = res[step]["score"]
        assert ranked(score)[0] == ((int(layer), int(head)), pytest.approx(float(best), abs=5e-4))
        assert float(np.median(score.values)) == pytest.approx(float(re.search(r"median head ([0-9.]+)", row).group(1)),
                                                                abs=5e-4)
        means = [float(x) for x in re.search(r"mean per layer ([0-9., ]+[0-9])", row).group(1).split(", ")]
        assert score.mean("head").values.round(3).tolist() == means
        assert res[step].attrs["chance"] == 0.5 and res[step].attrs["forwards"] == 25
    for step in ("sav_top", "sav_all"):
        row = doc[doc.index(f"| `{step}` ("):].splitlines()[0]
        assert round(float(res[step]["accuracy"]), 2) == float(re.search(r"accuracy ([0-9.]+)", row).group(1))
    assert res["sav_top"].attrs["n_heads"] == 20 and res["sav_all"].attrs["n_heads"] == 32
    assert "0.655 held-out accuracy" in README and "0.58 on held-out contexts against 0.52" in README
    report_in_browser("probes", workdir, ["pr: accuracy sorted per layer", "means: accuracy sorted per layer"])


@pytest.mark.slow
def test_circuits_as_typed(workdir):
    """Every circuit step of specs/circuits.yaml runs and is reported; the figures the README quotes are the run's."""
    run = run_spec("circuits", workdir)
    res = run.results
    row = readme_row("circuits")

    def quoted(pattern: str) -> tuple[float, ...]:
        m = re.search(pattern, row)
        assert m, f"the README's circuits row no longer says {pattern!r}"
        return tuple(float(x) for x in m.groups())

    patch = res["patch"]
    assert quoted(r"clean ([0-9.]+), corrupted (-?[0-9.]+)") == (round(float(patch["clean"].mean()), 2),
                                                                 round(float(patch["corrupt"].mean()), 2))
    # residual stream patching: the two tokens where the prompts differ (the queried key, the last token)
    resid = res["patch_resid"]["score"]
    assert resid.dims == ("layer", "token")
    assert float(abs(resid.isel(token=slice(None, -2))).max()) == 0.0  # the prompts are equal before the key
    key, last = resid.isel(token=-2).values, resid.isel(token=-1).values
    assert round(float(key[0]), 2) == round(float(key[1]), 2) == quoted(r"layers 0-1 \(([0-9.]+)\)")[0]
    assert (round(float(key[2]), 2), round(float(last[2]), 2)) == quoted(r"\(([0-9.]+) key / ([0-9.]+) last token\)")
    assert round(float(last[3]), 2) == quoted(r"by layer 3 \(([0-9.]+)\)")[0]
    top = ranked(patch["score"])
    assert [(h, round(s, 2)) for h, s in top[:2]] == [((1, 5), quoted(r"L1H5 \(([0-9.]+)\)")[0]),
                                                      ((2, 0), quoted(r"L2H0 \(([0-9.]+)\)")[0])]
    dla = res["dla"]
    (l31,) = quoted(r"L3H1 ([0-9.]+)")
    assert ranked(dla["score"])[0][0] == (3, 1) and round(float(dla["score"].sel(layer=3, head=1)), 2) == l31
    assert {h for h, _ in ranked(dla["score"])[:7]} == {(3, h) for h in (0, 1, 3, 4, 5, 6, 7)}
    heads, rest, total = quoted(r"heads ([0-9.]+) \+ rest ([0-9.]+) = ([0-9.]+)")
    assert (round(float(dla["score"].sum()), 2), round(float(dla["rest"].mean()), 2),
            round(float(dla["logit_diff"].mean()), 2)) == (heads, rest, total)
    atp = res["atp"]
    assert atp.attrs["reference_step"] == "patch"
    recall, rho = quoted(r"AtP recalls ([0-9]+) of exact patching's top 10 heads \(Spearman ([0-9.]+)\)")
    assert (round(atp.attrs["top_k_recall"] * 10), round(atp.attrs["spearman"], 2)) == (recall, rho)
    assert round(float(atp["score"].sel(layer=1, head=5)), 2) == quoted(r"but gives L1H5 (-?[0-9.]+)")[0] < 0
    eap = res["eap"]
    assert int(eap["in_circuit"].sum()) == eap.attrs["circuit_edges"] == 50
    normalised, faithfulness = quoted(r"circuit keeps ([0-9.]+) of the clean - corrupted gap \(faithfulness ([0-9.]+)\)")
    assert (round(eap.attrs["faithfulness_normalised"], 2), round(eap.attrs["faithfulness"], 2)) == (normalised,
                                                                                                      faithfulness)
    assert eap.attrs["faithfulness"] == pytest.approx(float(eap["circuit"].mean() / eap["clean"].mean()))
    assert round(res["sinks"].attrs["sink_rate"], 2) == quoted(r"sink rate ([0-9.]+)")[0]
    html = (workdir / "circuits.html").read_text()
    for step in res:
        assert f'id="step-{step}"' in html
    report_in_browser("circuits", workdir)
