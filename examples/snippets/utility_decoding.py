"""The example of `decoding` in docs/plugins.md, "Utilities for plugins": it runs with ``lm`` (a loaded
model) and ``examples`` (``headlab.Example``s with targets) given, as tests/test_docs_plugins.py runs it."""
# ruff: noqa: F821

# --8<-- [start:example]
from typing import Literal

import torch

from headlab import tokenize
from headlab.decoding import Selection, generator_for, pick, repetition_penalty
from headlab.generation import DecodeRequest, decode_loop


class PenalisedGreedy(Selection):
    """Greedy (or sampled) decoding with HF's repetition penalty."""

    kind: Literal["penalised_greedy"] = "penalised_greedy"
    penalty: float = 1.3


def decode(config, request):
    gen = generator_for(request, config)  # seeded from request.seed when sampling, else None
    prompt = request.batch

    def choose(outputs, state):
        ids = torch.cat([prompt.input_ids, state.generated], dim=1)
        mask = torch.cat([prompt.attention_mask, state.active.long()], dim=1)
        return pick(repetition_penalty(outputs.logits[:, -1], ids, mask, config.penalty), config, gen)

    return decode_loop(request, choose)


decoded = decode(PenalisedGreedy(), DecodeRequest(lm, tokenize(lm, examples), max_new_tokens=5))
# --8<-- [end:example]
