"""Helpers shared by the detector tests: a word-level tokenizer and tiny random models built in-process
(nothing downloaded), with a headlab copy and an eager copy of the same weights."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

WORDS = "ant bee cat dog eel fox gnu hen ibis jay".split()
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def word_tokenizer(words: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A fast word-level tokenizer (BOS prepended), one token per word or punctuation run."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + list(words or WORDS) + [".", "?", ":", "Q", "A"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                               pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+"), behavior="isolated")])
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    from tokenizers import decoders

    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def tiny_config(vocab_size: int, **over) -> dict:
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": vocab_size,
           "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    cfg.update(over)
    return cfg


def build_models(cfg: dict, seed: int = 0, tokenizer=None, impls=("headlab", "eager")):
    """The same random weights under several attention implementations; headlab's as a LoadedModel."""
    from headlab import instrument as ins
    from headlab.model import LoadedModel, geometry_of

    ins.register()
    cfg = dict(cfg)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    out = {}
    state = None
    for impl in impls:
        torch.manual_seed(seed)
        m = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
        if state is None:
            state = m.state_dict()
        else:
            m.load_state_dict(state)
        out[impl] = m
    lm = LoadedModel(model=out["headlab"], tokenizer=tokenizer, name="tiny", geometry=geometry_of(out["headlab"]))
    return lm, out


def save_tokenizer(tok: PreTrainedTokenizerFast, path: Path) -> str:
    tok.save_pretrained(str(path))
    return str(path)
