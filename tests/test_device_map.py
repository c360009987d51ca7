"""Models beyond one device (issue [robustness]): ``model: {device_map, max_memory, offload_folder}`` places a
checkpoint's modules through accelerate, and a model with layers offloaded to the CPU and to disk gives what
the unsplit model gives: logits, attention probes (a detector) and steering (a steered generation). The
checkpoint is a tiny random Llama the test writes, with the headlab-tiny tokenizer; nothing is downloaded."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

import headlab
from headlab.model import load_model
from headlab.spec import ModelSpec, SpecError

pytest.importorskip("accelerate")

SPLIT = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
         "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "disk"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A 4-layer random Llama (vocabulary of headlab-tiny) saved as a Hugging Face checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("ckpt")
    src = Path(__file__).parent.parent / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, path / name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=811, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def model_yaml(path: Path, placement: str = "") -> str:
    return f"model: {{path: {path}{', ' + placement if placement else ''}}}\n"


def test_an_offloaded_model_gives_the_logits_of_the_unsplit_one(checkpoint, tmp_path):
    whole = load_model(ModelSpec(path=str(checkpoint), device="cpu"))
    split = load_model(ModelSpec(path=str(checkpoint), device_map=SPLIT, offload_folder=str(tmp_path / "off")))
    assert split.device == "cpu" and dict(split.model.hf_device_map) == SPLIT
    offloaded = [name for name, p in split.model.named_parameters() if p.device.type == "meta"]
    assert any(".layers.1." in n for n in offloaded) and any(".layers.3." in n for n in offloaded)  # on disk
    assert not any(".layers.0." in n for n in offloaded)
    # (safetensors weights placed on disk are read from the checkpoint itself, so offload_folder may stay empty)
    ids = torch.tensor([whole.tokenizer("the cat sat on the mat and the dog sat on the rug")["input_ids"]])
    with torch.no_grad():
        a = whole.model(ids).logits
        b = split.model(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert split.geometry == whole.geometry and split.digest == whole.digest


STEPS = """task: {kind: repeated_tokens, n: 3, length: 12}
steps:
  - id: ind
    detect: {kind: induction}
  - id: gen
    generate:
      max_new_tokens: 4
      steer: [{kind: head_scale, heads: {from: ind, top: 2}, factor: 0.0}]
  - id: plain
    generate: {max_new_tokens: 4}
"""


def test_probes_and_steering_on_an_offloaded_model_equal_the_unsplit_model(checkpoint, tmp_path):
    whole = headlab.run("name: whole\n" + model_yaml(checkpoint, "device: cpu") + STEPS, out=tmp_path / "a")
    placement = f"device_map: {SPLIT}, offload_folder: {tmp_path / 'off'}".replace("'", "")
    split = headlab.run("name: split\n" + model_yaml(checkpoint, placement) + STEPS, out=tmp_path / "b")
    assert split.status == "complete" and split.attrs["device"] == "cpu"
    for step in ("ind", "gen", "plain"):
        a, b = whole.results[step], split.results[step]
        a.attrs.pop("model", None), b.attrs.pop("model", None)
        xr.testing.assert_identical(a, b)
    # the steering changed something (zeroing the two top induction heads), identically on both
    assert (whole.results["gen"]["output"].values != whole.results["plain"]["output"].values).any() or \
        not (whole.results["gen"]["logprob"].values == whole.results["plain"]["logprob"].values).all()


def test_device_map_auto_spills_past_max_memory_to_disk_with_the_same_logits(checkpoint, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU machine fills its GPUs first (benchmarks/gpu_check.py checks that split)")
    whole = load_model(ModelSpec(path=str(checkpoint), device="cpu"))
    lm = load_model(ModelSpec(path=str(checkpoint), device_map="auto", max_memory={"cpu": "500KB"},
                              offload_folder=str(tmp_path / "off")))
    placed = dict(getattr(lm.model, "hf_device_map", {}))
    assert lm.device == "cpu" and set(placed.values()) == {"cpu", "disk"}, placed
    ids = torch.tensor([whole.tokenizer("the cat sat on the mat")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(whole.model(ids).logits, lm.model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("placement, message", [
    ("device: cpu, device_map: auto", "give device ('cpu') or device_map, not both"),
    ("device_map: {model.layers.0: disk}", "device_map puts modules on 'disk': give offload_folder"),
    ("device_map: {model.layers.0: gpu}", "device_map['model.layers.0'] is 'gpu': give a GPU index"),
    ("device_map: {}", "device_map is empty"),
    ("max_memory: {cpu: 1GiB}", "max_memory needs device_map"),
    ("device_map: auto, max_memory: {cpu: lots}", "max_memory['cpu']:"),
    ("device_map: auto, max_memory: {tpu: 1GiB}", "max_memory key 'tpu'"),
])
def test_placements_that_cannot_work_are_refused_at_the_key(checkpoint, placement, message):
    with pytest.raises(SpecError) as info:
        headlab.load_spec("name: t\n" + model_yaml(checkpoint, placement) + STEPS)
    assert message in str(info.value) and ":2:" in str(info.value), str(info.value)


def test_a_gpu_the_machine_lacks_is_one_model_load_line(checkpoint, tmp_path):
    if torch.cuda.device_count() > 3:
        pytest.skip("this machine has a cuda:3")
    from headlab.model import ModelLoadError

    with pytest.raises(ModelLoadError, match="cuda:3"):
        load_model(ModelSpec(path=str(checkpoint), device_map={**SPLIT, "model.layers.0": 3},
                             offload_folder=str(tmp_path)))


def test_a_config_built_model_is_placed_the_same_way(tmp_path):
    config = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 97}
    whole = load_model(ModelSpec(config=config, device="cpu"), seed=5)
    placed = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk",
              "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    split = load_model(ModelSpec(config=config, device_map=placed, offload_folder=str(tmp_path / "off")), seed=5)
    assert split.device == "cpu" and split.model.hf_device_map == placed
    assert any((tmp_path / "off").iterdir())  # weights built in memory are written to offload_folder
    assert any(p.device.type == "meta" for n, p in split.model.named_parameters() if ".layers.0." in n)
    ids = torch.tensor([[1, 5, 9, 2, 5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(whole.model(ids).logits, split.model(ids).logits, rtol=0, atol=0)


# --------------------------------------------------------------------------- weight-reading detectors
#: every part a weight reader reads on disk somewhere: the embedding, two layers, the final norm, the unembedding
ON_DISK = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
           "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "disk", "lm_head": "disk"}


def test_the_anatomy_of_an_offloaded_model_reads_its_real_weights_one_module_at_a_time(checkpoint, tmp_path):
    whole = load_model(ModelSpec(path=str(checkpoint), device="cpu"))
    split = load_model(ModelSpec(path=str(checkpoint), device_map=ON_DISK, offload_folder=str(tmp_path / "off")))
    attn = split.attention_module(1)
    assert attn.q_proj.weight.device.type == "meta"  # offloaded: nothing in memory between forwards
    for layer in range(4):
        a, b = whole.head_weights(layer), split.head_weights(layer)
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            assert getattr(b, name).device.type == "cpu"
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)
    for name in ("embedding", "unembedding"):
        got = getattr(split, name)
        assert got.device.type == "cpu" and float(got.abs().sum()) > 0
        torch.testing.assert_close(getattr(whole, name), got, rtol=0, atol=0)
    # the weights were loaded for the call and dropped again: the model still holds nothing of the offloaded modules
    assert attn.q_proj.weight.device.type == "meta" and split.model.lm_head.weight.device.type == "meta"
    assert split.model.model.embed_tokens.weight.device.type == "meta"
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(whole.unembed(hidden), split.unembed(hidden), rtol=0, atol=0)
    norm = split.input_norm(3)
    with split.weights_loaded(norm, attn):
        assert norm.weight.device.type == "cpu" and attn.o_proj.weight.device.type == "cpu"
        torch.testing.assert_close(norm(hidden), whole.input_norm(3)(hidden), rtol=0, atol=0)
        torch.testing.assert_close(norm.weight, whole.input_norm(3).weight, rtol=0, atol=0)  # still loaded
        assert split.model.model.layers[3].mlp.up_proj.weight.device.type == "meta"  # only what was asked for
    assert norm.weight.device.type == "meta" and attn.o_proj.weight.device.type == "meta"
    weight = whole.input_norm(3).weight
    with whole.weights_loaded(whole.input_norm(3)):  # nothing offloaded: the parameter itself, untouched
        assert whole.input_norm(3).weight is weight


WEIGHT_READERS = """task: {kind: kv_swap, n: 4, num_pairs: 3}
steps:
  - id: successor
    detect: {kind: successor}
  - id: negative
    detect: {kind: copy_suppression, tokens: 64, k: 5}
  - id: eigen
    detect: {kind: copy_suppression, tokens: 8, k: 5, copying: eigen, block: 100}
  - id: comp
    detect: {kind: composition, baseline_samples: 10}
  - id: dla
    detect: {kind: direct_logit_attribution, batch_size: 2}
  - id: eap
    detect: {kind: edge_attribution, method: eap_ig, ig_steps: 2, circuit: {top: 10}}
"""


def test_weight_reading_detectors_on_an_offloaded_model_equal_the_unsplit_model(checkpoint, tmp_path):
    whole = headlab.run("name: whole\n" + model_yaml(checkpoint, "device: cpu") + WEIGHT_READERS, out=tmp_path / "a")
    placement = f"device_map: {ON_DISK}, offload_folder: {tmp_path / 'off'}".replace("'", "")
    split = headlab.run("name: split\n" + model_yaml(checkpoint, placement) + WEIGHT_READERS, out=tmp_path / "b")
    assert whole.status == split.status == "complete"
    for step, names in (("successor", ["score"]), ("negative", ["score", "copying"]), ("eigen", ["copying"]),
                        ("comp", ["q_comp", "k_comp", "v_comp"]), ("dla", ["score", "dla", "rest", "logit_diff"]),
                        ("eap", ["score"])):
        a, b = whole.results[step], split.results[step]
        for name in names:
            np.testing.assert_allclose(b[name].values, a[name].values, rtol=1e-6, atol=1e-9, err_msg=f"{step}.{name}")
    # scores of real weights: the heads differ (placeholder or zero weights would give one value everywhere)
    for step in ("successor", "negative", "comp", "dla"):
        assert np.unique(split.results[step]["score"].values).size > 1, step
    assert np.abs(split.results["dla"]["logit_diff"].values).min() > 0


@pytest.mark.parametrize("kind", ["successor", "copy_suppression", "copying_eigen"])
def test_ov_circuit_detectors_load_each_offloaded_module_once_per_run(checkpoint, tmp_path, monkeypatch, kind):
    import accelerate.utils

    from headlab import Example, StepContext
    from headlab.plugins.detectors import copy_suppression, successor

    split = load_model(ModelSpec(path=str(checkpoint), device_map=ON_DISK, offload_folder=str(tmp_path / "off")))
    names = {id(m): n for n, m in split.model.named_modules()}
    loads: dict[str, int] = {}
    align = accelerate.utils.align_module_device

    def counted(module, *args, **kwargs):
        loads[names[id(module)]] = loads.get(names[id(module)], 0) + 1
        return align(module, *args, **kwargs)

    monkeypatch.setattr(accelerate.utils, "align_module_device", counted)
    ctx = StepContext(model=split, examples=[Example(prompt="a")], results={}, seed=0)
    if kind == "successor":
        ds = successor.detect(successor.Successor(), ctx)
    else:
        copying = "eigen" if kind == "copying_eigen" else "top_k"
        ds = copy_suppression.detect(copy_suppression.CopySuppression(tokens=64, row_block=16, block=100,
                                                                      copying=copying), ctx)
    assert np.unique(ds["score"].values).size > 1
    # the embedding, the unembedding, the final norm and each offloaded layer's attention and input norm: once each
    assert loads and set(loads.values()) == {1}, loads
    assert {"model.embed_tokens", "lm_head", "model.norm", "model.layers.1.input_layernorm", "model.layers.3.self_attn.v_proj",
            "model.layers.3.self_attn.o_proj"} \
        <= set(loads), loads


# --------------------------------------------------------------------------- KV policies
KV_POLICIES = {
    "streaming": "{kind: streaming, full_heads: {from: ind, top: 1}, sink: 1, window: 3}",
    "headkv": "{kind: headkv, scores: {from: ind}, budget: {tokens_per_head: 8}, observation_window: 3}",
    "razor": "{kind: razor, full_heads: {from: ind, top: 1}, sink: 1, window: 3}",
    "random": "{kind: random, n_full: 1, sink: 1, window: 3, prefill_chunk: 5}",
    "full": "{kind: full, prefill_chunk: 4}",
}


def kv_steps(kv: str) -> str:
    return f"""task: {{kind: kv_swap, n: 3}}
steps:
  - id: ind
    detect: {{kind: induction}}
  - id: gen
    generate: {{max_new_tokens: 4, kv: {kv}}}
  - id: sc
    score: {{kv: {kv}}}
"""


@pytest.mark.parametrize("policy", sorted(KV_POLICIES))
def test_kv_policies_on_an_offloaded_model_equal_the_unsplit_model(checkpoint, tmp_path, policy):
    steps = kv_steps(KV_POLICIES[policy])
    whole = headlab.run("name: whole\n" + model_yaml(checkpoint, "device: cpu") + steps, out=tmp_path / "a")
    placement = f"device_map: {ON_DISK}, offload_folder: {tmp_path / 'off'}".replace("'", "")
    split = headlab.run("name: split\n" + model_yaml(checkpoint, placement) + steps, out=tmp_path / "b")
    assert whole.status == split.status == "complete"
    for step in ("gen", "sc"):
        a, b = whole.results[step], split.results[step]
        assert b.attrs["kv_policy"] == policy and b.attrs["kv_attention"] == a.attrs["kv_attention"]
        assert b.attrs["kv_kept_fraction"] < 1 or policy == "full"  # the caches dropped keys
        for name in ("kv_bytes", "kv_full", "kv_kept_fraction"):
            np.testing.assert_array_equal(b[name].values, a[name].values, err_msg=f"{step}.{name}")
        assert b.attrs["kv_bytes_full"] == a.attrs["kv_bytes_full"] > 0
    np.testing.assert_array_equal(split.results["gen"]["output_ids"].values, whole.results["gen"]["output_ids"].values)
    np.testing.assert_allclose(split.results["sc"]["logprob"].values, whole.results["sc"]["logprob"].values,
                               rtol=0, atol=1e-5)


def _held(layer) -> list[torch.Tensor]:
    """Every key and value tensor a headwise cache layer holds."""
    keys, values, _ = layer.compressed()
    parts = [keys, values] if isinstance(keys, torch.Tensor) else [*keys, *values]
    return [layer.keys, layer.values, *parts]


@pytest.mark.parametrize("policy", ["streaming", "headkv"])
def test_a_headwise_cache_on_an_offloaded_model_holds_each_layer_where_it_runs(checkpoint, tmp_path, policy):
    from headlab.kv import HeadBudgetMap, HeadMap, HeadwiseCache, KvBudget, kv_policy

    whole = load_model(ModelSpec(path=str(checkpoint), device="cpu"))
    split = load_model(ModelSpec(path=str(checkpoint), device_map=ON_DISK, offload_folder=str(tmp_path / "off")))
    if policy == "streaming":
        full = np.array([[True, False], [False, False], [False, True], [False, False]])
        head_map = HeadMap(xr.DataArray(full, dims=("layer", "kv_head")), sink=1, window=3)
    else:
        scores = xr.DataArray(np.arange(8, dtype=float).reshape(4, 2), dims=("layer", "kv_head"))
        head_map = HeadBudgetMap.allocate(scores, KvBudget(tokens_per_head=5), observation_window=3,
                                          token_bytes=128).for_length(12)
    ids = torch.tensor([whole.tokenizer("the cat sat on the mat and the dog sat on the rug")["input_ids"][:12]])
    seen = {}
    for name, lm in (("whole", whole), ("split", split)):
        with torch.no_grad(), kv_policy(lm.model, head_map) as usage:
            out = lm.model(ids, use_cache=True)
            steps = [out.logits]
            for _ in range(3):  # greedy decode steps continuing the policy's cache
                out = lm.model(out.logits[:, -1:].argmax(-1), cache=out.cache, use_cache=True)
                steps.append(out.logits)
        assert isinstance(out.cache, HeadwiseCache)
        for layer in out.cache.layers:  # every layer of this placement runs on the CPU, offloaded ones included
            assert {t.device for t in _held(layer)} == {torch.device("cpu")}
        seen[name] = (torch.cat(steps, dim=1), usage.layer_bytes.copy(), usage.layer_full_bytes.sum())
    torch.testing.assert_close(seen["split"][0], seen["whole"][0], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(seen["split"][1], seen["whole"][1])
    assert 0 < seen["split"][1].sum() < seen["split"][2]  # compressed: fewer bytes than a full cache


def test_the_kv_peak_memory_is_measured_on_every_gpu_a_device_map_uses():
    from headlab.kv.driver import cuda_devices

    placed = torch.nn.Linear(2, 2)
    placed.hf_device_map = {"a": 1, "b": "cpu", "c": "cuda:0", "d": "disk", "e": 1, "f": "cuda:3"}
    assert cuda_devices(placed) == [torch.device("cuda", i) for i in (0, 1, 3)]
    assert cuda_devices(torch.nn.Linear(2, 2)) == []  # on the CPU, nothing placed


def test_weights_loaded_with_their_parent_module_are_read_through_it(tmp_path):
    """accelerate's ``preload_module_classes``: the attention's hook loads its projections for its whole
    forward, the projections have no hook of their own."""
    from accelerate import dispatch_model

    from headlab.model import LoadedModel

    config = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 97}
    whole = load_model(ModelSpec(config=config, device="cpu"), seed=5)
    placed = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk",
              "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    model = dispatch_model(copy.deepcopy(whole.model), device_map=placed, offload_dir=str(tmp_path),
                           preload_module_classes=["LlamaAttention"])
    lm = LoadedModel(model=model, tokenizer=None, name="parted", geometry=whole.geometry)
    attn = lm.attention_module(0)
    assert not hasattr(attn.q_proj, "_hf_hook") and attn.q_proj.weight.device.type == "meta"
    a, b = whole.head_weights(0), lm.head_weights(0)
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)
    with lm.weights_loaded(attn.v_proj):
        torch.testing.assert_close(attn.v_proj.weight, whole.attention_module(0).v_proj.weight, rtol=0, atol=0)
    assert attn.v_proj.weight.device.type == "meta"
