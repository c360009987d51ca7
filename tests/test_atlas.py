"""The head atlas (docs/atlas.md): the shared pattern pass against eager attention and the published pattern
definitions, each slice against its detector run as its own spec step, labels and thresholds against the null,
a constructed previous-token head, and the errors of ``headlab atlas``."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

import headlab
from headlab import Example
from headlab.cli import main
from headlab.plugins.atlas.atlas import AtlasSkipped, build_atlas, pattern_scores, reinitialised

from fixtures.detectors import build_models, tiny_config, word_tokenizer

PATTERN = ["previous_token", "duplicate_token", "induction", "attention_sink"]


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer GQA Llama (4 query heads, 2 key/value heads, head_dim 8) on the word tokenizer, random weights
    (std 0.2, so attention is far from uniform), as a LoadedModel and as an eager copy with the same weights."""
    tok = word_tokenizer()
    lm, models = build_models(tiny_config(len(tok), hidden_size=32, initializer_range=0.2), seed=3, tokenizer=tok)
    return lm, models["eager"]


def repeated(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    seg = rng.integers(4, vocab, size=length).tolist()
    return [1, *seg, *seg]


def reference_scores(eager, ids: list[int]) -> dict[str, np.ndarray]:
    """(layer, head) scores of one sequence from eager attention and the published definitions: the mul score
    sum(A*D)/sum(A) of the previous-token, duplicate-token and induction patterns (the last two with A[:, 0]
    zeroed), and the sink score mean_{i >= 1} A[i, 0]."""
    with torch.no_grad():
        att = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    A = np.stack([a[0].double().numpy() for a in att])  # (layer, head, query, key)
    n = len(ids)
    t = np.array(ids)
    prev = np.zeros((n, n))
    prev[np.arange(1, n), np.arange(n - 1)] = 1
    dup = np.tril(t[:, None] == t[None, :], -1).astype(float)
    ind = np.zeros((n, n))
    ind[:, 1:] = dup[:, :-1]
    ind = np.tril(ind)
    no_bos = A.copy()
    no_bos[..., 0] = 0
    mul = lambda a, d: (a * d).sum((-1, -2)) / a.sum((-1, -2))  # noqa: E731
    return {"previous_token": mul(A, prev), "duplicate_token": mul(no_bos, dup), "induction": mul(no_bos, ind),
            "attention_sink": A[..., 1:, 0].mean(-1)}


def test_the_shared_pattern_pass_equals_eager_attention_and_the_definitions(tiny):
    lm, eager = tiny
    rng = np.random.default_rng(0)
    vocab = lm.model.config.vocab_size
    seqs = [repeated(rng, 6, vocab), repeated(rng, 6, vocab), repeated(rng, 9, vocab), repeated(rng, 6, vocab)]
    got = pattern_scores(lm, [Example(prompt="", input_ids=s) for s in seqs], PATTERN, batch_size=2)
    for i, ids in enumerate(seqs):
        want = reference_scores(eager, ids)
        for name in PATTERN:
            np.testing.assert_allclose(got[name][i], want[name], atol=1e-5, err_msg=f"{name}, sequence {i}")
    assert got["previous_token"].std() > 0.05  # the random heads differ: the comparison can fail


@pytest.fixture(scope="module")
def tiny_atlas(tmp_path_factory):
    """``headlab atlas headlab-tiny`` (in process, every text detector but retrieval, the importance ones
    included, small tasks) and the run of the spec steps the cube records for its slices."""
    out = tmp_path_factory.mktemp("atlas")
    names = ["previous_token", "duplicate_token", "induction", "attention_sink", "successor", "copy_suppression",
             "copying", "composition", "head_importance", "ships"]
    main(["atlas", "headlab-tiny", "--out", str(out), "--tokens", "16", "--n", "2", "--importance", "--detectors",
          ",".join(names)])  # returns when done (exits only on an error)
    (path,) = list(out.iterdir())
    ds = headlab.open_run(str(path)).results["atlas"]
    return (ds, *alone(ds, "headlab-tiny", out / "alone"))


def alone(ds: xr.Dataset, model, out: Path) -> tuple[dict, headlab.Run]:
    """The cube's ``detector_steps`` and the run of a spec holding each of them as a step with its own task."""
    steps = json.loads(ds.attrs["detector_steps"])
    spec = {"name": "slices", "model": model, "seed": int(ds.attrs["seed"]), "task": steps["previous_token"]["task"],
            "steps": [{"id": name, "task": step["task"], "detect": step["detect"]} for name, step in steps.items()]}
    return steps, headlab.run(spec, out=str(out))


def assert_same_slices(ds: xr.Dataset, steps: dict, run: headlab.Run) -> None:
    for name, step in steps.items():
        want = run.results[name][step["variable"]]
        want = want.mean("example") if "example" in want.dims else want
        np.testing.assert_allclose(ds["score"].sel(detector=name).values, want.transpose("layer", "head").values,
                                   atol=1e-6, err_msg=name)


def test_headlab_atlas_on_headlab_tiny_stores_the_cube(tiny_atlas):
    ds, steps, _ = tiny_atlas
    assert set(ds["score"].dims) == {"detector", "layer", "head"}
    assert list(ds["detector"].values) == list(steps)
    assert ds.sizes["layer"] == 4 and ds.sizes["head"] == 8
    for var in ("label", "rank", "threshold", "default_threshold", "threshold_source", "null_mean", "null_std",
                "n_examples"):
        assert var in ds, var
    assert "re-initialised" in ds.attrs["null"] and json.loads(ds.attrs["skipped"]) == {}
    # headlab-tiny was trained to have these heads (docs/model-card.md): L2H0 previous-token, layer 3 induction
    prev = ds["label"].sel(detector="previous_token")
    assert bool(prev.sel(layer=2, head=0)) and int(prev.sum()) <= 4
    assert int(ds["rank"].sel(detector="previous_token", layer=2, head=0)) == 1


def test_each_slice_equals_its_detector_as_its_own_spec_step(tiny_atlas):
    ds, steps, run = tiny_atlas
    assert_same_slices(ds, steps, run)
    for name, step in steps.items():
        assert step["detect"]["kind"] in (name, "copy_suppression")
        assert float(np.abs(ds["score"].sel(detector=name)).max()) > 0, name  # a slice of zeros would pass too
        if name in PATTERN:
            assert int(ds["n_examples"].sel(detector=name)) == len(run.results[name]["example"]) == 2


def test_labels_follow_the_recorded_thresholds_and_the_null(tiny):
    lm, _ = tiny
    names = ["previous_token", "induction", "attention_sink", "composition"]
    ds = build_atlas(lm, detectors=names, tokens=12, n=3, null="reinit", seed=5)
    # the null: the same detectors on a copy re-initialised here (std 0.2, the config's initializer_range)
    null = copy.deepcopy(lm.model)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for pname, p in null.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 if p.dim() >= 2 else
                    torch.zeros_like(p) if pname.endswith("bias") else torch.ones_like(p))
    null_lm = headlab.LoadedModel(model=null, tokenizer=lm.tokenizer, name="null", geometry=lm.geometry)
    want_null = build_atlas(null_lm, detectors=names, tokens=12, n=3, null="none", seed=5)
    np.testing.assert_allclose(ds["null_score"].values, want_null["score"].values, atol=1e-9)
    for i in range(len(names)):
        s = ds["null_score"].values[i].ravel()
        mean, std = s.mean(), s.std(ddof=1)
        assert float(ds["null_mean"][i]) == pytest.approx(mean) and float(ds["null_std"][i]) == pytest.approx(std)
        default = float(ds["default_threshold"][i])
        assert float(ds["threshold"][i]) == pytest.approx(max(default, mean + 3 * std))
        assert bool(ds["threshold_raised"][i]) == (mean + 3 * std > default)
        if bool(ds["threshold_raised"][i]):
            assert "null mean + 3 std" in str(ds["threshold_source"][i].values)
        score = ds["score"].values[i]
        np.testing.assert_array_equal(ds["label"].values[i], score >= float(ds["threshold"][i]))
        order = sorted((-score[l_, h], l_, h) for l_ in range(score.shape[0]) for h in range(score.shape[1]))
        want_rank = np.zeros(score.shape, dtype=int)
        for r, (_, l_, h) in enumerate(order, 1):
            want_rank[l_, h] = r
        np.testing.assert_array_equal(ds["rank"].values[i], want_rank)
    assert "re-initialised" in ds.attrs["null"] and "seed 5" in ds.attrs["null"]
    assert bool(ds["threshold_raised"].any()) and not bool(ds["threshold_raised"].all())


def test_the_null_leaves_the_model_alone_and_is_seeded(tiny):
    lm, _ = tiny
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    a, b, c = reinitialised(lm, 1), reinitialised(lm, 1), reinitialised(lm, 2)
    for k, v in lm.model.state_dict().items():
        assert torch.equal(v, before[k])
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(sa[w], sb[w]) and not torch.equal(sa[w], sc[w]) and not torch.equal(sa[w], before[w])
    assert float(sa[w].std()) == pytest.approx(0.2, rel=0.1)
    assert torch.equal(sa["model.norm.weight"], torch.ones_like(sa["model.norm.weight"]))


def previous_token_head(lm, eager, head: int = 2, scale: float = 12.0) -> None:
    """Make head ``head`` of layer 0 attend to position t - 1, in both models: every embedding gets a constant
    first coordinate (1, the rest small), the head's query reads it into the first rotary pair of frequencies 1
    and 0.1, its key head the same rotated by one position, so q_t . k_s = c (cos(t-s-1) + cos(0.1 (t-s-1))),
    largest at s = t - 1 whatever the tokens are."""
    d_head = 8
    kv = head // 2
    for model in (lm.model, eager):
        attn = model.model.layers[0].self_attn
        with torch.no_grad():
            emb = model.model.embed_tokens.weight
            emb.mul_(0.02 / emb.std())
            emb[:, 0] = 1.0
            q = attn.q_proj.weight
            q[head * d_head:(head + 1) * d_head] = 0
            q[head * d_head + 0, 0] = 1.0
            q[head * d_head + 1, 0] = 1.0
            k = attn.k_proj.weight
            k[kv * d_head:(kv + 1) * d_head] = 0
            for i, theta in ((0, 1.0), (1, 0.1)):
                k[kv * d_head + i, 0] = scale * np.cos(theta)
                k[kv * d_head + i + d_head // 2, 0] = scale * np.sin(theta)


def test_a_constructed_previous_token_head_is_labelled_previous_token():
    tok = word_tokenizer()
    lm, models = build_models(tiny_config(len(tok), hidden_size=32, initializer_range=0.02), seed=1, tokenizer=tok)
    previous_token_head(lm, models["eager"])
    ids = repeated(np.random.default_rng(1), 10, lm.model.config.vocab_size)
    with torch.no_grad():
        att = models["eager"](input_ids=torch.tensor([ids]), output_attentions=True).attentions[0][0, 2]
    assert float(att[torch.arange(1, len(ids)), torch.arange(len(ids) - 1)].mean()) > 0.9  # the construction works
    ds = build_atlas(lm, detectors=["previous_token", "induction", "attention_sink"], tokens=24, n=4, seed=0)
    label = ds["label"].sel(detector="previous_token")
    assert bool(label.sel(layer=0, head=2)) and int(label.sum()) == 1
    assert int(ds["rank"].sel(detector="previous_token", layer=0, head=2)) == 1
    assert float(ds["threshold"].sel(detector="previous_token")) >= 0.5


def test_a_detector_whose_task_cannot_be_built_is_skipped_with_a_line(tiny):
    lm, _ = tiny  # the word tokenizer has no digits, number words, weekdays, months or letters
    with pytest.warns(AtlasSkipped, match="skipped successor: successor: no item of any sequence"):
        ds = build_atlas(lm, detectors=["successor", "previous_token"], tokens=8, n=2, null="none")
    assert list(ds["detector"].values) == ["previous_token"]
    assert "no item of any sequence" in json.loads(ds.attrs["skipped"])["successor"]


def _cli_error(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err and "skipped" not in err, err
    return errors[0]


def test_headlab_atlas_errors_are_one_located_line(capsys, tmp_path):
    err = _cli_error(capsys, ["atlas", "headlab-tiny", "--out", str(tmp_path), "--detectors", "previous,induction"])
    assert "command line: --detectors: unknown atlas detector 'previous'" in err and "previous_token" in err
    err = _cli_error(capsys, ["atlas", str(tmp_path / "nowhere"), "--out", str(tmp_path)])
    assert "is neither a registered model" in err and "local checkpoint directory" in err
    err = _cli_error(capsys, ["atlas", "headlab-tiny", "--out", str(tmp_path), "--detectors", "segment_divergence"])
    assert "no detector applies to headlab-tiny" in err and "segment_divergence: the model reads no images" in err



def test_the_atlas_action_is_a_spec_step(tiny_llama, tmp_path):
    spec = {"name": "atlas", "model": {"config": tiny_llama}, "task": {"kind": "repeated_tokens", "n": 2, "length": 4},
            "steps": [{"id": "a", "atlas": {"detectors": ["previous_token", "induction"], "tokens": 8, "n": 2,
                                            "null": "none"}}]}
    ds = headlab.run(spec, out=str(tmp_path)).results["a"]
    assert isinstance(ds, xr.Dataset) and list(ds["detector"].values) == ["previous_token", "induction"]
    with pytest.raises(headlab.SpecError, match="unknown atlas detector 'induct'"):
        headlab.load_spec({**spec, "steps": [{"id": "a", "atlas": {"detectors": ["induct"]}}]})


HEADLAB = Path(sys.executable).parent / "headlab"  # the console script, as a user types it


def typed(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    res = subprocess.run([str(HEADLAB), *args], capture_output=True, text=True, cwd=cwd, timeout=1200)
    assert res.returncode == 0, f"{args}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr and "error:" not in res.stderr, res.stderr
    return res


def stored_cube(out: Path) -> xr.Dataset:
    (path,) = list(out.iterdir())
    return headlab.open_run(str(path)).results["atlas"]


@pytest.mark.slow
def test_headlab_atlas_as_typed_on_the_embedded_model(tmp_path):
    res = typed(["atlas", "headlab-tiny", "--out", "runs"], tmp_path)
    assert "atlas: skipped segment_divergence: the model reads no images" in res.stderr
    ds = stored_cube(tmp_path / "runs")
    assert "segment_divergence" not in ds["detector"].values and "retrieval" in ds["detector"].values
    assert "previous_token" in res.stdout and "labelled" in res.stdout
    assert bool(ds["label"].sel(detector="previous_token", layer=2, head=0))
    assert int(ds["label"].sel(detector="induction").sel(layer=3).sum()) >= 3
    assert_same_slices(ds, *alone(ds, "headlab-tiny", tmp_path / "alone"))  # retrieval among them


@pytest.mark.slow
def test_headlab_atlas_as_typed_on_a_saved_gqa_llama_and_the_tiny_llava(tmp_path):
    tok = word_tokenizer()
    lm, _ = build_models(tiny_config(len(tok), hidden_size=32, initializer_range=0.2), seed=0, tokenizer=tok,
                         impls=("headlab",))
    ckpt = tmp_path / "gqa-llama"
    lm.model.save_pretrained(str(ckpt))
    tok.save_pretrained(str(ckpt))
    res = typed(["atlas", str(ckpt), "--out", "gqa", "--tokens", "16", "--n", "2"], tmp_path)
    assert "atlas: skipped successor" in res.stderr  # the word tokenizer has no ordinal tokens
    ds = stored_cube(tmp_path / "gqa")
    assert ds.sizes["layer"] == 2 and ds.sizes["head"] == 4 and "composition" in ds["detector"].values
    res = typed(["atlas", "headlab-tiny-vlm", "--out", "vlm", "--tokens", "16", "--n", "2", "--importance"], tmp_path)
    ds = stored_cube(tmp_path / "vlm")
    assert {"segment_divergence", "head_importance", "ships"} <= set(ds["detector"].values)
    assert_same_slices(ds, *alone(ds, "headlab-tiny-vlm", tmp_path / "alone-vlm"))  # the image detector among them
    assert "null mean + 3 std" in str(ds["threshold_source"].sel(detector="segment_divergence").values)
