"""Widget state on the Python side: HeadMap selection -> heads / spec fragment / PASTA JSON,
AttentionView rows checked against eager attention, RunBrowser/Compare tables against the datasets."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import xarray as xr

from fixtures.specs import spec_text

pytest.importorskip("anywidget")
pytest.importorskip("ipywidgets")

import headlab  # noqa: E402
from headlab.heads import from_pasta_json, ranked, select_heads  # noqa: E402
from headlab.widgets import (  # noqa: E402
    AttentionView,
    Compare,
    HeadMap,
    RunBrowser,
    diff_html,
    generation_table,
    metric_table,
    top_heads_table,
)

WORDS = ("the a cat dog sat on mat and ran to house key is value secret number what was . , ? : "
         "one two three four five six seven eight nine ten").split()


def word_tokenizer():
    """A word-level fast tokenizer built here (nothing downloaded), BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="module")
def lm():
    from transformers import AutoConfig, AutoModelForCausalLM

    from headlab.instrument import ATTN_IMPLEMENTATION, register
    from headlab.model import LoadedModel, geometry_of

    register()
    tok = word_tokenizer()
    cfg = AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, vocab_size=len(tok),
                               max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION).eval()
    return LoadedModel(model=model, tokenizer=tok, name="tiny-test", geometry=geometry_of(model))


def eager_attention(lm, input_ids: torch.Tensor) -> np.ndarray:
    """(layer, head, query, key) from the same weights run with eager attention and output_attentions."""
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_config(copy.deepcopy(lm.model.config), attn_implementation="eager").eval()
    eager.load_state_dict(lm.model.state_dict())
    with torch.no_grad():
        att = eager(input_ids=input_ids, output_attentions=True).attentions
    return torch.stack([a[0] for a in att]).numpy()


PROMPT = ("the cat sat on the mat . the secret number is seven . the dog ran to the house . "
          "what was the secret number ?")


# --------------------------------------------------------------------------- HeadMap
def test_headmap_selection_as_heads_fragment_and_pasta():
    scores = np.arange(12, dtype=float).reshape(3, 4) / 11
    scores[1, 1] = np.nan
    hm = HeadMap(scores, title="demo")
    assert hm.n_layers == 3 and hm.n_heads == 4
    assert hm.values[1][1] is None and hm.values[2][3] == pytest.approx(1.0)
    assert (hm.vmin, hm.vmax) == (0.0, 1.0)
    assert hm.heads == [] and hm.fragment == "(no heads selected)"

    hm.select([(2, 1), (0, 3), (2, 1)])  # unsorted, duplicated
    assert hm.selected == [[0, 3], [2, 1]]
    assert hm.heads == [(0, 3), (2, 1)]
    assert hm.spec_fragment == "heads: [[0, 3], [2, 1]]"
    assert hm.pasta_json == {"0": [3], "2": [1]}
    assert hm.fragment == 'heads: [[0, 3], [2, 1]]\nPASTA: {"0": [3], "2": [1]}'

    # a click toggles, a drag adds a block (either corner order), alt-drag removes one
    hm.toggle(0, 3)
    assert hm.heads == [(2, 1)]
    hm.select_rect((2, 1), (0, 1))  # layers 1..2 x heads 0..1, added to (2, 1)
    assert set(hm.heads) == {(1, 0), (1, 1), (2, 0), (2, 1)}
    hm.select_rect((2, 2), (1, 0), remove=True)
    assert set(hm.heads) == {(1, 0), (1, 1)}

    # the fragment is valid spec YAML for a head selection, and resolves to the same heads
    from pydantic import TypeAdapter
    from ruamel.yaml import YAML

    parsed = YAML(typ="safe", pure=True).load(hm.spec_fragment)["heads"]
    assert [tuple(h) for h in TypeAdapter(headlab.HeadSelection).validate_python(parsed)] == hm.heads
    assert select_heads(parsed, {}) == hm.heads
    assert sorted(from_pasta_json(json.loads(json.dumps(hm.pasta_json)))) == hm.heads

    with pytest.raises(Exception, match="outside this map"):
        hm.select([(3, 0)])
    assert set(hm.heads) == {(1, 0), (1, 1)}  # unchanged after a rejected selection


def test_headmap_rectangle_and_view_round_trip():
    hm = HeadMap(np.zeros((4, 5)))
    seen = []
    hm.on_select(seen.append)
    hm.select_rect((1, 2), (3, 1))
    assert hm.heads == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]
    # what the browser view sends: a new `selected` list (as JSON would give it)
    hm.set_state({"selected": [[3, 4], [0, 0]]})
    assert hm.heads == [(0, 0), (3, 4)]
    assert hm.spec_fragment == "heads: [[0, 0], [3, 4]]"
    assert seen[-1] == [(0, 0), (3, 4)] and len(seen) == 2
    hm.clear()
    assert hm.heads == [] and seen[-1] == []


def test_headmap_top_and_threshold_follow_ranking():
    rng = np.random.default_rng(3)
    da = xr.DataArray(rng.random((2, 3, 4)), dims=("task.length", "layer", "head"),
                      coords={"task.length": [8, 16]})
    hm = HeadMap(da)  # the sweep dimension is averaged
    np.testing.assert_allclose(np.array(hm.values), da.mean("task.length").values)
    expected = [h for h, _ in ranked(da.mean("task.length"))[:3]]
    assert hm.select_top(3).heads == sorted(expected)
    mean = da.mean("task.length").values
    t = float(np.sort(mean.ravel())[-5])
    assert set(hm.select_threshold(t).heads) == {(int(a), int(b)) for a, b in zip(*np.where(mean >= t), strict=True)}
    picked = HeadMap(da, **{"task.length": 16})
    np.testing.assert_allclose(np.array(picked.values), da.sel({"task.length": 16}).values)
    assert hm.selection_scores()[0][1] == pytest.approx(mean.max())
    svg = hm._repr_html_()
    # the static fallback is headlab.figures' heatmap: a cell per head, the selected ones outlined
    assert svg.startswith("<svg") and svg.count('aria-roledescription="rect mark"') == 12 + len(hm.heads)
    assert svg.count('stroke="#e4002b"') == len(hm.heads) > 0


def test_headmap_rejects_bad_inputs():
    with pytest.raises(ValueError, match="layer and head"):
        HeadMap(xr.DataArray(np.zeros((2, 2)), dims=("a", "b")))
    with pytest.raises(ValueError, match="no `score`"):
        HeadMap(xr.Dataset({"x": ("a", [1.0])}))
    with pytest.raises(ValueError, match=r"\(layer, head\)"):
        HeadMap(np.zeros(3))


# --------------------------------------------------------------------------- AttentionView
def test_attention_view_rows_match_eager_attention_in_both_modes(lm):
    needle = (PROMPT.index("the secret"), PROMPT.index(" . the dog"))
    full = AttentionView(lm, PROMPT, layer=1, head=2, spans={"needle": [needle]})
    paged = AttentionView(lm, PROMPT, layer=1, head=2, mode="query", page_size=8)
    assert full.mode == "pattern" and paged.mode == "query"
    assert full.tokens[:4] == ["<bos>", "the", "cat", "sat"] and full.n_tokens == 27
    ref = eager_attention(lm, full.input_ids)
    for q in (0, 7, 13, full.n_tokens - 1):
        for layer in range(2):
            for head in range(4):
                np.testing.assert_allclose(full.row(layer, head, q), ref[layer, head, q, : q + 1], atol=1e-5)
                np.testing.assert_allclose(paged.row(layer, head, q), ref[layer, head, q, : q + 1], atol=1e-5)
    # span mass through Probes(spans=...) equals the eager row summed over the needle's tokens
    s, e = full.token_spans["needle"][0]
    assert full.tokens[s:e] == ["the", "secret", "number", "is", "seven"]
    mass = full.span_mass()
    assert mass.dims == ("span", "layer", "head")
    np.testing.assert_allclose(mass.sel(span="needle").values, ref[:, :, -1, s:e].sum(-1), atol=1e-5)
    top = full.top_keys(3)
    order = np.argsort(-ref[1, 2, -1])[:3]
    assert [p for p, _, _ in top] == [int(i) for i in order]


def test_attention_view_paging_and_controls(lm):
    v = AttentionView(lm, PROMPT, layer=0, head=1, query=5, page_size=8, pattern_limit=4)
    assert v.mode == "query" and v.n_pages == 4
    assert v.page == 0 and v.page_range() == (0, 8)
    assert v.view.offset == 0 and v.view.tokens == v.tokens[:8]
    # keys after the query are not coloured (causal)
    assert v.view.weights[6:] == [None, None] and all(x is not None for x in v.view.weights[:6])
    np.testing.assert_allclose(v.view.weights[:6], v.row(0, 1, 5), atol=1e-7)
    # moving the query to another page moves the page
    v.set(query=20)
    assert v.page == 2 and v.view.offset == 16 and v.view.tokens == v.tokens[16:24]
    np.testing.assert_allclose([x for x in v.view.weights if x is not None], v.row(0, 1, 20)[16:21], atol=1e-7)
    # a click on a token in the view sets the query
    v.view.query = 18
    assert v.query == 18 and v.view.weights[3] is None and v.view.weights[2] is not None
    v.set(layer=1, head=3)
    np.testing.assert_allclose(v.view.weights[:3], v.row(1, 3, 18)[16:19], atol=1e-7)
    assert "layer 1 head 3" in v.view.caption and "most attended" in v.info.value
    # earlier pages show the query's attention on those keys
    v.set(page=0)
    np.testing.assert_allclose(v.view.weights, v.row(1, 3, 18)[:8], atol=1e-7)


def test_attention_view_span_colouring(lm):
    needle = (PROMPT.index("the secret"), PROMPT.index(" . the dog"))
    v = AttentionView(lm, PROMPT, spans={"needle": [needle], "question": [(PROMPT.index("what"), len(PROMPT))]})
    v.colour_by.value = "spans"
    mass = v.span_mass().sel(layer=v.layer, head=v.head)
    s, e = v.token_spans["needle"][0]
    assert v.view.weights[s:e] == [pytest.approx(float(mass.sel(span="needle")))] * (e - s)
    assert v.view.weights[0] is None
    assert v.view.spans[0] == [s, e, "needle"]
    assert "mass on spans" in v.info.value


def test_attention_view_token_ids_without_tokenizer():
    from headlab.model import load_model
    from headlab.spec import ModelSpec

    from fixtures.specs import TINY_LLAMA

    lm = load_model(ModelSpec(config=dict(TINY_LLAMA), device="cpu"))
    ids = [5, 6, 7, 8, 5, 6, 7, 8]
    v = AttentionView(lm, input_ids=ids, layer=1, head=0)
    assert v.tokens == [str(i) for i in ids] and v.query == 7
    ref = eager_attention(lm, torch.tensor([ids]))
    np.testing.assert_allclose(v.row(1, 0), ref[1, 0, 7], atol=1e-5)
    with pytest.raises(ValueError, match="prompt or input_ids"):
        AttentionView(lm)


# --------------------------------------------------------------------------- runs: browser and compare
STEPS = ("  - id: ind\n    detect: {kind: induction}\n"
         "  - id: greedy\n    generate: {max_new_tokens: 3, metrics: [exact_match, contains]}\n"
         "  - id: sampled\n    generate: {decode: {kind: sample, temperature: 5.0}, max_new_tokens: 3, "
         "metrics: [contains]}\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    a = headlab.run(spec_text(STEPS, sweep="  task.length: [5, 7]\n", task="{kind: repeated_tokens, n: 3, length: 5}",
                              out=str(out)))
    b = headlab.run(spec_text(STEPS, task="{kind: repeated_tokens, n: 3, length: 6}", out=str(out)))
    return out, a, b


def test_metric_table_matches_datasets(runs):
    _, a, b = runs
    table = metric_table([a, b])
    assert list(table["run"]).count(a.path.name) == 4 and list(table["run"]).count(b.path.name) == 2
    row = table[(table["run"] == a.path.name) & (table["step"] == "greedy") & (table["task.length"] == 7)].iloc[0]
    ds = a.results["greedy"].sel({"task.length": 7})
    assert row["contains"] == pytest.approx(float(ds["contains"].mean()))
    assert row["exact_match"] == pytest.approx(float(ds["exact_match"].mean())) and row["n"] == 3
    assert row["decode"] == "greedy"
    brow = table[(table["run"] == b.path.name) & (table["step"] == "sampled")].iloc[0]
    assert brow["decode"] == "sample" and np.isnan(brow["exact_match"])
    heads = top_heads_table([a])
    assert len(heads) == 2 and set(heads["task.length"]) == {5, 7}
    best = ranked(a.results["ind"]["score"].sel({"task.length": 5}))[0]
    assert heads.iloc[0]["#1"] == f"L{best[0][0]}H{best[0][1]} {best[1]:.3f}"


def test_generations_side_by_side_with_differences(runs):
    _, a, _ = runs
    table = generation_table([a])
    assert list(table.columns) == ["prompt", "target", "greedy [task.length=5]", "greedy [task.length=7]",
                                   "sampled [task.length=5]", "sampled [task.length=7]"]
    for i in range(3):
        assert table.loc[i, "greedy [task.length=7]"] == str(a.results["greedy"]["output"].sel(
            {"task.length": 7}).isel(example=i).values)
    assert diff_html("the cat sat", "the dog sat") == 'the <mark class="hl-diff">dog</mark><del class="hl-del">cat</del> sat'
    assert diff_html("a b", "a b") == "a b"
    cmp = Compare([a])
    html = cmp.generations_html.value
    assert html.count("<tr>") == 4 and "greedy [task.length=5]" in html
    differs = sum(1 for i in range(3) if table.iloc[i, 2] != table.iloc[i, 4])
    assert html.count("hl-differs") >= differs > 0  # sampling at temperature 5 differs from greedy
    assert "metrics" in cmp.metrics_html.value and "L" in cmp.heads_html.value


def test_run_browser_lists_and_shows(runs):
    out, a, b = runs
    browser = RunBrowser(out)
    assert [r.path for r in browser.runs] == [a.path, b.path]
    assert a.path.name in browser.table.value and "complete" in browser.table.value
    browser.select([b])
    summary, maps, compare = browser.detail.children
    assert "headlab run" in summary.value
    (hm,) = maps.children
    assert isinstance(hm, HeadMap)
    np.testing.assert_allclose(np.array(hm.values), b.results["ind"]["score"].values)
    assert isinstance(compare, Compare) and compare.runs[0].path == b.path
    browser.select([])
    assert browser.detail.children == ()
