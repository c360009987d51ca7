"""The circuit detectors from specs: docs/circuits.md's examples pass ``headlab validate``, and one spec of a
pair task with all four detectors runs on the embedded model, its logit differences equal to the model's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import headlab

ROOT = Path(__file__).parent.parent
CHECKPOINT = ROOT / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny" / "model.safetensors"
KINDS = ("direct_logit_attribution", "activation_patching", "attribution_patching", "attention_sink", "successor",
         "copy_suppression", "edge_attribution", "path_patching")

SPEC = """\
name: circuits
model: headlab-tiny
task: {kind: kv_swap, n: 6, num_pairs: 5}
steps:
  - id: dla
    detect: {kind: direct_logit_attribution, batch_size: 4}
  - id: sinks
    detect: {kind: attention_sink}
  - id: successor
    detect: {kind: successor}
  - id: negative
    detect: {kind: copy_suppression, tokens: 64, k: 5}
  - id: patch
    detect: {kind: activation_patching, batch_size: 32}
  - id: atp
    detect: {kind: attribution_patching, reference: patch, top_k: 5}
  - id: eap
    detect: {kind: edge_attribution, method: eap_ig, ig_steps: 2, circuit: {top: 40}}
"""


def doc_blocks() -> list[str]:
    """The yaml blocks of docs/circuits.md."""
    return re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "circuits.md").read_text(), flags=re.S)


def test_the_docs_examples_validate(tmp_path):
    blocks = doc_blocks()
    kinds = set()
    paths = []
    for i, block in enumerate(blocks):
        data = yaml.safe_load(block)
        spec = {"name": f"doc{i}", "model": "headlab-tiny", "task": {"kind": "kv_swap", "n": 2}}
        spec.update(data if isinstance(data, dict) else {"steps": data})
        kinds.update(step["detect"]["kind"] for step in spec["steps"])
        path = tmp_path / f"doc{i}.yaml"
        path.write_text(yaml.safe_dump(spec))
        paths.append(str(path))
    assert kinds == set(KINDS)
    (tmp_path / "spec.yaml").write_text(SPEC)
    res = subprocess.run([sys.executable, "-m", "headlab.cli", "validate", *paths, str(tmp_path / "spec.yaml")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count(": ok") == len(paths) + 1


@pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
def test_a_pair_task_spec_runs_every_circuit_detector(tmp_path):
    run = headlab.run(yaml.safe_load(SPEC), out=tmp_path / "runs")
    dla = run.results["dla"]
    for step in ("dla", "sinks", "successor", "negative", "patch", "atp"):
        assert run.results[step]["score"].dims == ("layer", "head")
    lm = headlab.model.load_model(headlab.spec.ModelSpec(id="headlab-tiny", device="cpu"))
    prompts = [str(p) for p in dla["prompt"].values]
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([lm.tokenizer(prompt).input_ids])
        with torch.no_grad():
            logits = lm.model(input_ids=ids).logits[0, -1]
        diff = float(logits[int(dla["answer_id"][i])] - logits[int(dla["wrong_id"][i])])
        assert float(dla["logit_diff"][i]) == pytest.approx(diff, abs=1e-4)
        assert float(dla["dla"][i].sum() + dla["rest"][i]) == pytest.approx(diff, abs=1e-4)
    # the embedded model retrieves the queried value: the clean logit difference favours the answer
    assert float(dla["logit_diff"].mean()) > 1
    assert np.isfinite(run.results["sinks"]["massive_ratio"].values).all()
    # the patching steps read the same clean logit differences as DLA, and compare with each other
    for step in ("patch", "atp"):
        np.testing.assert_allclose(run.results[step]["clean"].values, dla["logit_diff"].values, atol=1e-4)
    assert run.results["patch"]["score"].dims == ("layer", "head")
    assert -1 <= run.results["atp"].attrs["spearman"] <= 1
    # edge attribution: one score per edge of the graph, and the top 40 edges patched exactly
    eap = run.results["eap"]
    assert eap["score"].dims == ("edge",) and int(eap["in_circuit"].sum()) == 40
    assert {"emb", "a0.h0", "m3"} <= set(eap["source"].values.tolist())
    assert {"a0.h0.q", "a3.kv3.v", "m0", "logits"} <= set(eap["destination"].values.tolist())
    np.testing.assert_allclose(eap["clean"].values, dla["logit_diff"].values, atol=1e-4)
    assert eap.attrs["faithfulness"] == pytest.approx(float(eap["circuit"].mean() / eap["clean"].mean()), rel=1e-9)
