"""headlab.generation's decoding loop: its bookkeeping (left padding, EOS, stop strings, finished rows)
against transformers' own ``model.generate``, dropping finished rows, the hooks, the model's pad/EOS ids,
and that the codebase has exactly one KV-cache decoding loop."""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest
import torch

from headlab.context import Example
from headlab.generation import DecodeRequest, DecodeState, ModelCall, PromptSplit, Rows, decode_loop, tokenize
from headlab.model import LoadedModel, load_model
from headlab.spec import ModelSpec

from fixtures.decoding import model_config, word_tokenizer

# "abcdef": transformers' stop-string matcher tokenizes it to read the vocabulary
WORDS = ("<pad> <bos> <eos> <unk> the capital of is in paris rome berlin madrid lisbon question what answer : ? "
         "italy france a b c d e f g h i j k l m n o p q r s t u v w x y z abcdef").split()
PROMPTS = ["the capital of france is", "a b c", "what is the capital of italy ? answer :", "paris rome"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    """A random 2-layer Llama (headlab attention) whose greedy outputs are varied (large init range)."""
    cfg = model_config(layers=2, vocab_size=len(WORDS), max_position_embeddings=128)
    model = load_model(ModelSpec(config=cfg, device="cpu"), seed=2)
    model.tokenizer = word_tokenizer(WORDS)
    return model


def greedy(out, state: DecodeState) -> torch.Tensor:
    return out.logits[: state.rows.shape[0], -1].argmax(-1)


def hf_generate(lm: LoadedModel, batch, max_new: int, eos: list[int] | None, stop: list[str]) -> torch.Tensor:
    """New tokens of transformers' greedy ``generate`` (finished rows padded with the pad id, 0)."""
    kw = {"stop_strings": stop, "tokenizer": lm.tokenizer} if stop else {}
    with torch.no_grad():
        out = lm.model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask, do_sample=False,
                                max_new_tokens=max_new, pad_token_id=0, eos_token_id=eos, **kw)
    return out[:, batch.length:]


def test_decode_loop_equals_transformers_generate(lm):
    """Left-padded prompts of different lengths; rows end at an EOS id, at a stop string, or at
    max_new_tokens: the loop's generated tokens (pad after a finished row), tokens and texts equal
    transformers' greedy ``generate`` with the same EOS ids and stop string."""
    tok = lm.tokenizer
    batch = tokenize(lm, [Example(prompt=p) for p in PROMPTS])
    assert len(set(batch.pad)) > 1  # the rows really are left-padded
    max_new = 10
    free = hf_generate(lm, batch, max_new, eos=None, stop=[]).tolist()
    # a second EOS id: a word row 0 generates at step >= 2; a stop string: a word row 1 generates later
    i = next(i for i in range(2, max_new) if free[0][i] > 3 and free[0][i] not in free[0][:i])
    eos_x = free[0][i]
    j = next(j for j in range(2, max_new) if free[1][j] > 3 and eos_x not in free[1][: j + 1]
             and sum(WORDS[free[1][j]] in w for w in WORDS) == 1 and free[1][j] not in free[1][:j])
    stop_word = WORDS[free[1][j]]

    saved = lm.model.generation_config.eos_token_id
    lm.model.generation_config.eos_token_id = [2, eos_x]
    try:
        assert lm.eos_ids == sorted({2, eos_x})
        ref = hf_generate(lm, batch, max_new, eos=[2, eos_x], stop=[stop_word])
        state = DecodeState(DecodeRequest(lm, batch, max_new, [stop_word]))
        decoded = decode_loop(state, greedy)
    finally:
        lm.model.generation_config.eos_token_id = saved
    assert torch.equal(state.generated, ref)

    ends, ref_tokens, ref_texts = [], [], []
    for row in ref.tolist():  # each row up to its end by the rules: EOS id, stop string, max_new_tokens
        n, end = len(row), "max"
        for k, t in enumerate(row):
            if t in (2, eos_x):
                n, end = k + 1, "eos"
                break
            if stop_word in tok.decode(row[: k + 1], skip_special_tokens=True):
                n, end = k + 1, "stop"
                break
        assert all(t == 0 for t in row[n:])  # generate pads after the row's last token
        ends.append(end)
        ref_tokens.append(row[: n - 1] if end == "eos" else row[:n])
        text = tok.decode(ref_tokens[-1], skip_special_tokens=True)
        ref_texts.append(text[: text.index(stop_word)] if stop_word in text else text)
    assert ends[:2] == ["eos", "stop"] and "max" in ends and state.step == max_new
    assert decoded.tokens == ref_tokens
    assert decoded.texts == ref_texts
    assert state.active.sum(1).tolist() == [len(t) + (e == "eos") for t, e in zip(ref_tokens, ends, strict=True)]
    assert state.finished.tolist() == [e != "max" for e in ends]


def test_a_padded_prompt_decodes_like_itself_alone(lm):
    batch = tokenize(lm, [Example(prompt=p) for p in PROMPTS])
    together = decode_loop(DecodeRequest(lm, batch, 6), greedy)
    for r, p in enumerate(PROMPTS):
        alone = decode_loop(DecodeRequest(lm, tokenize(lm, [Example(prompt=p)]), 6), greedy)
        assert alone.tokens[0] == together.tokens[r]


@pytest.mark.parametrize("copies", [1, 2])
def test_dropping_finished_rows_keeps_outputs(lm, copies):
    """With ``drop_finished`` finished prompts leave the batch and the cache: same generated tokens, active
    steps, tokens and texts (also with copies of the rows and a prompt split for the prefill)."""
    batch = tokenize(lm, [Example(prompt=p) for p in PROMPTS])
    free = hf_generate(lm, batch, 8, eos=None, stop=[]).tolist()
    stop = [WORDS[free[1][5]], WORDS[free[2][4]]]  # two rows end early, at different steps
    rows = (batch.input_ids.repeat(copies, 1), batch.attention_mask.repeat(copies, 1))
    seen: list[list[int]] = []
    results = []
    for drop in (False, True):
        state = DecodeState(DecodeRequest(lm, batch, 8, stop), rows, drop_finished=drop)
        out = decode_loop(state, greedy, split=PromptSplit(),
                          on_step=lambda s: seen.append(s.rows.tolist()))
        results.append((state, out))
    (a, da), (b, db) = results
    assert torch.equal(a.generated, b.generated) and torch.equal(a.active, b.active)
    assert da.tokens == db.tokens and da.texts == db.texts
    lengths = [len(t) for t in da.tokens]
    assert len({n for n in lengths if n < 8}) == 2 and 8 in lengths  # rows finished at different steps
    dropped = seen[a.step:]
    assert dropped[0] == [0, 1, 2, 3] and len(dropped[-1]) < 4  # rows really left the batch
    assert b.cache.layers[0].keys.shape[0] == copies * len(dropped[-1])


def test_hooks_see_every_step(lm):
    """``ModelCall.around`` wraps each step's model call (not the split prefill); ``on_step`` follows it once
    the step's tokens are recorded; ``choose`` gets the state."""
    batch = tokenize(lm, [Example(prompt=p) for p in PROMPTS[:2]])
    events: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def around(state):
        events.append(("forward", state.step))
        yield

    def choose(out, state):
        events.append(("choose", state.step))
        assert state.outputs is out and state.cache is out.cache
        return out.logits[:, -1].argmax(-1)

    for split in (None, PromptSplit(then=lambda: events.append(("split", -1)))):
        events.clear()
        decode_loop(DecodeRequest(lm, batch, 3, []), choose, split=split, call=ModelCall(around=around),
                    on_step=lambda s: events.append(("step", s.step)))
        head = [("split", -1)] if split else []
        assert events == head + [e for t in range(3) for e in (("forward", t), ("choose", t), ("step", t + 1))]


def test_options_that_do_not_combine(lm):
    from headlab.instrument import Plan

    batch = tokenize(lm, [Example(prompt=p) for p in PROMPTS[:2]])
    with pytest.raises(ValueError, match="plan"):
        decode_loop(DecodeRequest(lm, batch, 2, [], Plan().mask_heads([(0, 0)])), greedy, rows=Rows(drop_finished=True))
    with pytest.raises(ValueError, match="multiple"):
        decode_loop(DecodeRequest(lm, batch, 2), greedy, rows=Rows(batch.input_ids[:1], batch.attention_mask[:1]))
    state = DecodeState(DecodeRequest(lm, batch, 2))
    with pytest.raises(ValueError, match="DecodeState"):
        decode_loop(state, greedy, rows=Rows(drop_finished=True))
    with pytest.raises(ValueError, match="together"):
        Rows(input_ids=batch.input_ids)


def test_pad_and_eos_ids_of_the_loaded_model(lm):
    assert lm.pad_id == 0 and lm.eos_ids == [2]
    bare = LoadedModel(model=None, tokenizer=None, name="x", geometry=lm.geometry)
    assert bare.pad_id == 0 and bare.eos_ids == []
    no_pad = type("Tok", (), {"pad_token_id": None, "eos_token_id": 7, "unk_token_id": 3})()
    assert LoadedModel(model=None, tokenizer=no_pad, name="x", geometry=lm.geometry).pad_id == 7


# --------------------------------------------------------------------------- exactly one KV-cache loop
CACHE_NAMES = {"cache", "past_key_values"}
# What ships and the examples; tools/ (scripts outside the package, e.g. tools/tiny/evaluate.py, whose
# plain-transformers loop keeps the model card's numbers independent of the engine they test) is not scanned.
SOURCE_DIRS = ("headlab", "examples")
# Standalone scripts in SOURCE_DIRS that keep their own loop on purpose, with the reason (none at present).
ALLOWED: dict[tuple[str, str], str] = {
    ("headlab/kv/driver.py", "_chunked_forward"): "one prefill fed in chunks into one cache (a KV policy's prefill_chunk), "
                                        "inside a forward of the model: no token is chosen",
}


def kv_cache_loops(source: str) -> list[tuple[str, int]]:
    """``(enclosing function, line)`` of every ``for``/``while`` loop that runs a model with a KV cache: a
    call inside the loop's own body passing ``cache=``/``past_key_values=`` (or ``use_cache=True``), or
    reading ``.cache``/``.past_key_values`` of an output or a ``"cache"`` key."""
    found = []

    def body_nodes(loop: ast.AST):
        stack = list(ast.iter_child_nodes(loop))
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue  # a function defined in a loop is not the loop's body
            yield node
            stack.extend(ast.iter_child_nodes(node))

    def is_cache_use(node: ast.AST) -> bool:
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in CACHE_NAMES:
                    return True
                if kw.arg == "use_cache" and isinstance(kw.value, ast.Constant) and kw.value.value is True:
                    return True
        if isinstance(node, ast.Attribute) and node.attr in CACHE_NAMES:
            return True
        return isinstance(node, ast.Constant) and node.value in CACHE_NAMES

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, (ast.For, ast.AsyncFor, ast.While)) and any(map(is_cache_use, body_nodes(child))):
                found.append((name, child.lineno))
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return found


def test_the_loop_finder_finds_loops():
    """The finder flags the loop shapes headlab had before (the retrieval detector's own loop, a
    ``past_key_values`` loop, a cache passed through a kwargs dict) and not a single cached step."""
    retrieval_loop = """
def probe_decode(model, ids, steps):
    cache = prefill(model, ids)
    for t in range(steps):
        with instrument(model, plan):
            out = model(input_ids=inp, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        cache = out.cache
        inp = out.logits[:, -1].argmax(-1)[:, None]
"""
    hf_style = """
def generate(model, ids, n):
    past = None
    while n:
        out = model(ids, past_key_values=past)
        past, n = out.past_key_values, n - 1
"""
    through_kwargs = """
def run(model, x):
    kw = {}
    for _ in range(3):
        out = model(x, **kw)
        kw["cache"] = out[1]
"""
    one_step = """
def single_query(model, ids, q):
    pre = model(input_ids=ids[:, :q], use_cache=True)
    return model(input_ids=ids[:, q:q + 1], cache=pre.cache)
"""
    assert kv_cache_loops(retrieval_loop) == [("probe_decode", 4)]
    assert kv_cache_loops(hf_style) == [("generate", 4)]
    assert kv_cache_loops(through_kwargs) == [("run", 4)]
    assert kv_cache_loops(one_step) == []


def test_exactly_one_kv_cache_decoding_loop():
    """Every decoding strategy and every detector that decodes runs ``headlab.generation.decode_loop``: the
    engine, the built-in plugins, the kernels and the example plugin hold exactly one KV-cache loop."""
    found = {}
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for func, line in kv_cache_loops(path.read_text()):
                found.setdefault((rel, func), []).append(line)
    assert set(ALLOWED) <= set(found), "an allowed loop is gone; drop it from ALLOWED"
    loops = {k: v for k, v in found.items() if k not in ALLOWED}
    assert list(loops) == [("headlab/generation.py", "decode_loop")], loops
    assert len(loops["headlab/generation.py", "decode_loop"]) == 1
