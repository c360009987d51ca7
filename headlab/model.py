"""Loading models and tokenizers with headlab's attention implementation; head geometry.

Any Hugging Face decoder-only model id or local checkpoint loads through transformers; a registered
name (the embedded default model) loads through its plugin; a ``config`` mapping builds a model with
random weights (tests, benchmarks). Geometry is always read from the loaded model's config
(:func:`geometry_of`). :class:`Geometry`, :func:`geometry_of` and :class:`ModelLoadError` live in the leaf
:mod:`headlab.geometry` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from huggingface_hub import constants, try_to_load_from_cache
from transformers.utils import logging as hf_logging

from . import anatomy
from .geometry import Geometry, ModelLoadError, geometry_of
from .instrument import ATTN_IMPLEMENTATION, register
from .plugin_manager import get_manager
from .spec import ModelSpec, parse_size
from .vision import image_token_id, processor_for_config, vision_tokens_for_config

__all__ = ["DTYPES", "HUB_PROBE_SECONDS", "Geometry", "LoadedModel", "ModelLoadError", "check_architecture",
           "check_vocabulary", "embedding_rows", "from_config", "from_pretrained", "geometry_of",
           "is_vision_checkpoint", "largest_token_id", "load_model", "load_model_by_name_tokenizer", "resolve_device", "state_digest", "weights_digest"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready for headlab: the torch module, its tokenizer and provenance."""

    model: Any
    tokenizer: Any
    name: str
    geometry: Geometry
    revision: str | None = None
    digest: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    processor: Any = None

    def __post_init__(self) -> None:
        # the tokenizer's "Token indices sequence length is longer than the specified maximum" warning is noise:
        # tasks tokenize long texts to cut them (a haystack), a run refuses a prompt longer than the model's
        # context window itself (naming the example and the fix), and headlab.generation.tokenize warns in one line
        warned = getattr(self.tokenizer, "deprecation_warnings", None)
        if isinstance(warned, dict):
            warned["sequence-length-is-longer-than-the-specified-maximum"] = True

    @property
    def is_vision(self) -> bool:
        """Whether the model reads images (it has a processor)."""
        return self.processor is not None

    @property
    def image_token_id(self) -> int | None:
        """The token id that stands for an image patch in the input (None for a text model)."""
        if self.processor is None:
            return None
        return image_token_id(self.processor, self.model.config)

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model was built for (``max_position_embeddings``, ``n_positions``), if it
        says."""
        config = self.model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    @property
    def pad_id(self) -> int:
        """The token id that pads batches: the tokenizer's pad token, else its EOS, else UNK, else 0."""
        for attr in ("pad_token_id", "eos_token_id", "unk_token_id"):
            value = getattr(self.tokenizer, attr, None)
            if value is not None:
                return int(value)
        return 0

    @property
    def eos_ids(self) -> list[int]:
        """The token ids that end a generation, sorted: the model's ``generation_config.eos_token_id`` (one
        or several) and the tokenizer's EOS. Read on every access, so a changed config takes effect."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list):
                ids.update(int(i) for i in src)
        return sorted(ids)

    # Model anatomy (headlab.anatomy): the parts of the language model, the same for every architecture.
    @property
    def decoder_layers(self) -> list[torch.nn.Module]:
        """The decoder layer modules of the language model, in order."""
        return anatomy.decoder_layers(self.model)

    def attention_module(self, layer: int) -> torch.nn.Module:
        """The self-attention module of decoder layer ``layer``."""
        return anatomy.attention_module(self.model, layer)

    def input_norm(self, layer: int) -> torch.nn.Module | None:
        """The norm feeding the attention of layer ``layer`` (None where the attention reads the residual)."""
        return anatomy.input_norm(self.model, layer)

    def query_key_norms(self, layer: int) -> tuple[torch.nn.Module, torch.nn.Module] | None:
        """``(q_norm, k_norm)`` of layer ``layer`` where the architecture has them (olmo2), else None."""
        return anatomy.query_key_norms(self.model, layer)

    def head_weights(self, layer: int) -> anatomy.HeadWeights:
        """The per-head attention weights of layer ``layer`` (TransformerLens' names and shapes)."""
        return anatomy.head_weights(self.model, layer)

    @property
    def embedding(self) -> torch.Tensor:
        """The input token embedding matrix ``W_E`` (vocab, d_model)."""
        return anatomy.embedding(self.model)

    @property
    def position_embedding(self) -> torch.Tensor | None:
        """The learned position embedding ``W_pos`` (positions, d_model) of gpt2; None with rotary embeddings."""
        return anatomy.position_embedding(self.model)

    @property
    def unembedding(self) -> torch.Tensor:
        """The unembedding ``W_U`` (d_model, vocab)."""
        return anatomy.unembedding(self.model)

    @property
    def unembedding_bias(self) -> torch.Tensor | None:
        """The unembedding bias ``b_U`` (vocab,), or None."""
        return anatomy.unembedding_bias(self.model)

    @property
    def final_norm(self) -> torch.nn.Module:
        """The norm applied to the last hidden state before the unembedding."""
        return anatomy.final_norm(self.model)

    def weights_loaded(self, *modules: torch.nn.Module | None) -> contextlib.AbstractContextManager[None]:
        """A context in which the parameters of ``modules`` (parts of this model) are real tensors on the device
        each computes on, also where ``device_map`` offloads them (:func:`headlab.anatomy.weights_loaded`)."""
        return anatomy.weights_loaded(self.model, *modules)

    def unembed(self, hidden: torch.Tensor, *, norm: bool = True) -> torch.Tensor:
        """Logits of hidden states (..., d_model) as the model's head computes them (final norm unless
        ``norm=False``, ``W_U``, ``b_U``, soft-capping)."""
        return anatomy.unembed(self.model, hidden, norm=norm)

    def provenance(self) -> dict[str, Any]:
        """Model facts recorded in every run's attributes."""
        return {"model": self.name, "model_revision": self.revision or "", "model_digest": self.digest or "",
                "device": self.device, "dtype": self.dtype, "n_layers": self.geometry.n_layers,
                "n_heads": self.geometry.n_heads, "n_kv_heads": self.geometry.n_kv_heads,
                "head_dim": self.geometry.head_dim}


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when available, else 'cpu'. A device this machine does not have is a
    :class:`ModelLoadError` (one line, before anything is loaded), never a torch traceback."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ModelLoadError(f"unknown device '{device}': use auto, cpu, cuda, cuda:<index>, mps or xpu") from None
    backend = {"cuda": torch.cuda, "mps": getattr(torch.backends, "mps", None), "xpu": getattr(torch, "xpu", None)}
    if dev.type in backend:
        module = backend[dev.type]
        if module is None or not module.is_available():
            raise ModelLoadError(f"device '{device}': this machine (torch {torch.__version__}) has no {dev.type.upper()} "
                                 "device; use device: auto (or cpu)")
        count = getattr(module, "device_count", lambda: 1)()
        if dev.index is not None and dev.index >= count:
            raise ModelLoadError(f"device '{device}': this machine has {count} {dev.type.upper()} device(s) "
                                 f"(indices 0..{count - 1})")
    elif dev.type != "cpu":
        raise ModelLoadError(f"device '{device}' is not supported: use auto, cpu, cuda, cuda:<index>, mps or xpu")
    return device


def weights_digest(path: Path) -> str:
    """sha256 over the checkpoint's weight files (safetensors or bin), in name order."""
    h = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest() if files else ""


def state_digest(model: torch.nn.Module) -> str:
    """sha256 over a model's parameters (for models built in memory)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return "sha256:" + h.hexdigest()


def from_pretrained(path_or_id: str, spec: ModelSpec, *, name: str | None = None) -> LoadedModel:
    """Load a Hugging Face checkpoint (directory or hub id) with headlab's attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer


    device = resolve_device(spec.device) if spec.device_map is None else _check_device_map(spec)
    register()
    kwargs: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code, "revision": spec.revision}
    if not Path(path_or_id).expanduser().is_dir():
        kwargs["local_files_only"] = _hub_source(path_or_id, spec.revision)
    placement = _placement(spec)
    dtype = "auto" if spec.dtype == "auto" else DTYPES[spec.dtype]

    config = _read_config(path_or_id, kwargs)
    if config is not None:
        check_architecture(config, path_or_id)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # headlab shows its own progress; a per-load bar is noise
    processor = None
    try:
        if config is not None and getattr(config, "vision_config", None) is not None:
            from transformers import AutoModelForImageTextToText, AutoProcessor

            processor = AutoProcessor.from_pretrained(path_or_id, **kwargs)
            tokenizer = processor.tokenizer
            check_vocabulary(tokenizer, config, path_or_id)
            model = AutoModelForImageTextToText.from_pretrained(path_or_id, dtype=dtype,
                                                                attn_implementation=ATTN_IMPLEMENTATION, **kwargs,
                                                                **placement)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path_or_id, **kwargs)
            if config is not None:
                check_vocabulary(tokenizer, config, path_or_id)
            model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype,
                                                         attn_implementation=ATTN_IMPLEMENTATION, **kwargs, **placement)
    except ModelLoadError:
        raise
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load model '{path_or_id}': {first.rstrip('.')}. Give a local checkpoint directory, "
                             "a registered name (see `headlab plugins`), or a reachable hub id") from None
    except Exception as e:  # a damaged checkpoint: safetensors, torch or a config class fails in its own way
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelLoadError(f"cannot load model '{path_or_id}': {type(e).__name__}: {first.rstrip('.')}. Is the "
                             "checkpoint complete and undamaged?") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    check_vocabulary(tokenizer, None, path_or_id, rows=embedding_rows(model))  # the rows the weights have
    if spec.device_map is None:
        model.to(device)
    else:
        device = input_device(model)
    model.eval()
    local = Path(path_or_id)
    digest = weights_digest(local) if local.is_dir() else _hub_commit(model)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name or path_or_id, geometry=geometry_of(model),
                       revision=spec.revision or _hub_commit(model), digest=digest, device=device,
                       dtype=str(model.dtype).removeprefix("torch."), processor=processor)


HUB_PROBE_SECONDS = 5.0
"""How long loading a hub id that is not in the local cache waits to reach the hub before it gives up."""


def _hub_source(repo_id: str, revision: str | None) -> bool:
    """Whether hub id ``repo_id`` must load from the local cache only (``local_files_only``): when the hub is
    offline (``HF_HUB_OFFLINE``) or cannot be reached within :data:`HUB_PROBE_SECONDS`. Not cached and not
    reachable is one :class:`ModelLoadError` line, at once, instead of the hub client's retries."""
    if repo_id.startswith(("/", "./", "../", "~")) or repo_id.count("/") > 1:
        raise ModelLoadError(f"model '{repo_id}': no such checkpoint directory (and not a hub id, which is "
                             "`name` or `owner/name`)")
    try:
        cached = isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str)
    except ValueError:  # not a valid repository id
        raise ModelLoadError(f"model '{repo_id}': no such checkpoint directory, registered name or hub id (see "
                             "`headlab plugins` for registered names)") from None
    if constants.HF_HUB_OFFLINE:
        if not cached:
            raise ModelLoadError(f"model '{repo_id}' is not a checkpoint directory and is not in the local Hugging "
                                 "Face cache, and HF_HUB_OFFLINE is set: download it first (`hf download "
                                 f"{repo_id}`) or give a checkpoint directory")
        return True
    problem = _unreachable(constants.ENDPOINT)
    if problem is None:
        return False
    if cached:
        return True
    raise ModelLoadError(f"model '{repo_id}' is not a checkpoint directory and is not in the local Hugging Face "
                         f"cache, and the hub cannot be reached ({problem}): connect, download it first "
                         f"(`hf download {repo_id}`), or give a checkpoint directory")


def _unreachable(endpoint: str) -> str | None:
    """Why a TCP connection to ``endpoint`` (or the HTTPS proxy in the environment) fails within
    :data:`HUB_PROBE_SECONDS`, or None when it connects."""

    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    target = urlsplit(proxy if proxy and endpoint.startswith("https") else endpoint)
    host = target.hostname or ""
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS):
            return None
    except TimeoutError:
        return f"{host}:{port}: no answer within {HUB_PROBE_SECONDS:g} s"
    except OSError as e:
        return f"{host}:{port}: {e.strerror or type(e).__name__}"


def _read_config(path_or_id: str, kwargs: dict[str, Any]) -> Any:
    """The checkpoint's transformers config, or None when it does not read (loading the model says why)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path_or_id, **kwargs)
    except (OSError, ValueError):
        return None


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_architecture(config: Any, name: str) -> None:
    """Refuse a model headlab cannot study, from its config alone (before any weight is read): an encoder
    or encoder-decoder (headlab needs a decoder-only language model) and a key/value head count that does not
    divide the query heads. A :class:`ModelLoadError` naming the model and the fix."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    text = _text_config(config)
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        raise ModelLoadError(f"model '{name}' ({model_type}) is an encoder-decoder model; headlab needs a "
                             "decoder-only language model (llama, mistral, qwen2, gemma2, gpt2, olmo2, phi3, ...)")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise ModelLoadError(f"model '{name}' is a {model_type} model, an encoder whose attention reads both "
                             "directions (its scores as a causal model would be meaningless); headlab needs a "
                             "decoder-only language model (llama, mistral, qwen2, gemma2, gpt2, olmo2, phi3, ...)")
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    kv = getattr(text, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and (kv < 1 or heads % kv):
        raise ModelLoadError(f"model '{name}': {heads} attention heads cannot share {kv} key/value heads "
                             f"(num_key_value_heads must divide num_attention_heads); use a divisor of {heads}, "
                             f"e.g. {max(d for d in range(1, min(max(kv, 1), heads) + 1) if heads % d == 0)}")


def largest_token_id(tokenizer: Any) -> int | None:
    """The largest token id ``tokenizer`` can produce: the largest id of its vocabulary (added tokens included),
    and at least ``len(tokenizer) - 1``; None for a tokenizer that says neither. A vocabulary with gaps (an
    added token at id 50,000 of a 32,000-token tokenizer) has a largest id beyond its length."""
    largest = -1
    with contextlib.suppress(TypeError):
        largest = len(tokenizer) - 1
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: its length is what is known
        vocab = None
    if isinstance(vocab, Mapping):
        ids = [i for i in vocab.values() if isinstance(i, int) and not isinstance(i, bool)]
        largest = max([largest, *ids])
    return largest if largest >= 0 else None


def embedding_rows(model: Any) -> int | None:
    """The rows of ``model``'s input embedding matrix (token ids ``0 .. rows - 1`` have one), or None when the
    model has no input embedding headlab can find."""
    try:
        embed = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    weight = getattr(embed, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def check_vocabulary(tokenizer: Any, config: Any, name: str, rows: int | None = None) -> None:
    """Refuse a tokenizer whose token ids do not all have a row in the model's input embedding (``rows``, else
    the config's ``vocab_size``): the first prompt holding such a token would fail inside the forward. The
    tokenizer's largest id (:func:`largest_token_id`: its vocabulary's largest id, gaps included) is compared;
    an embedding larger than the tokenizer (padded for speed, or reserving ids) is fine. A
    :class:`ModelLoadError` naming the model, the tokenizer's size and largest id, the embedding's rows and
    the fix."""
    if tokenizer is None:
        return
    if rows is None:
        rows = getattr(_text_config(config), "vocab_size", None)
    largest = largest_token_id(tokenizer)
    if largest is None or not isinstance(rows, int) or isinstance(rows, bool) or rows <= 0 or largest < rows:
        return
    try:
        size = f"{len(tokenizer):,} tokens"
    except TypeError:
        size = "a vocabulary"
    raise ModelLoadError(f"model '{name}': its tokenizer has {size} (ids up to {largest:,}) but its input "
                         f"embedding has {rows:,} rows, so a prompt with a token id from {rows:,} up would fail in "
                         f"the forward; give the tokenizer the model was trained with, or a model with vocab_size of "
                         f"at least {largest + 1:,}")


def _check_device_map(spec: ModelSpec) -> str:
    """Check that this machine has the GPUs ``spec.device_map`` names and that accelerate is installed (a
    :class:`ModelLoadError` otherwise); returns the device inputs go to until the model is placed."""
    try:
        import accelerate  # noqa: F401 - transformers places modules through it
    except ImportError:
        raise ModelLoadError("model.device_map needs accelerate: pip install accelerate") from None
    places = spec.device_map.values() if isinstance(spec.device_map, dict) else []
    for place in places:
        if isinstance(place, int) or str(place).startswith("cuda"):
            resolve_device(f"cuda:{place}" if isinstance(place, int) else str(place))
    return "cpu"


def _placement(spec: ModelSpec) -> dict[str, Any]:
    """The ``from_pretrained`` arguments that place the model's modules (none without ``device_map``)."""
    if spec.device_map is None:
        return {}

    out: dict[str, Any] = {"device_map": spec.device_map}
    if spec.max_memory is not None:
        out["max_memory"] = {int(k) if str(k).isdigit() else k: parse_size(v) for k, v in spec.max_memory.items()}
    if spec.offload_folder is not None:
        out["offload_folder"] = str(Path(spec.offload_folder).expanduser())
    return out


def _dispatch(model: Any, spec: ModelSpec) -> Any:
    """A model built in memory, placed on devices by ``spec.device_map`` (``auto``: as ``max_memory`` allows)
    through accelerate, as ``from_pretrained`` places a checkpoint."""
    from accelerate import dispatch_model, infer_auto_device_map

    placement = _placement(spec)
    device_map = placement["device_map"]
    if isinstance(device_map, str):
        device_map = infer_auto_device_map(model, max_memory=placement.get("max_memory"),
                                           no_split_module_classes=getattr(model, "_no_split_modules", None) or [])
    try:
        model = dispatch_model(model, device_map=device_map, offload_dir=placement.get("offload_folder"))
    except (ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"model.device_map: {type(e).__name__}: {e}") from None
    model.hf_device_map = dict(device_map)
    return model


def input_device(model: Any) -> str:
    """Where a model placed by a device map takes its inputs: the device of its input embedding's module
    (``cpu`` for modules offloaded to the CPU or to disk)."""
    placed = getattr(model, "hf_device_map", None) or {}
    try:
        embed = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # no input embedding to find: the first placed module's device
        embed = None
    names = {id(m): n for n, m in model.named_modules()}
    name = names.get(id(embed)) if embed is not None else None
    place = None
    if name is not None:
        for prefix, where in placed.items():
            if name == prefix or name.startswith(prefix + ".") or prefix == "":
                place = where
                break
    if place is None and placed:
        place = next(iter(placed.values()))
    if isinstance(place, int):
        return f"cuda:{place}"
    if place in (None, "cpu", "disk", "meta"):
        return "cpu"
    return str(place)


def is_vision_checkpoint(path_or_id: str, kwargs: dict[str, Any]) -> bool:
    """Whether a checkpoint is a vision-language model (its config has a ``vision_config``)."""
    config = _read_config(path_or_id, kwargs)  # None: the model load below reports the problem
    return config is not None and getattr(config, "vision_config", None) is not None


def _hub_commit(model: Any) -> str | None:
    return getattr(model.config, "_commit_hash", None)


def from_config(spec: ModelSpec, seed: int = 0) -> LoadedModel:
    """Build a model with random weights from a transformers config mapping."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    device = resolve_device(spec.device) if spec.device_map is None else _check_device_map(spec)
    register()
    cfg = dict(spec.config or {})
    model_type = cfg.pop("model_type", None)
    tokenizer_ref = cfg.pop("tokenizer", None)
    processor_options = cfg.pop("processor", None)
    if not model_type:
        raise ModelLoadError("model.config needs a `model_type` (e.g. llama, mistral, qwen2, gpt2)")
    vision = "vision_config" in cfg
    tokenizer = None
    if tokenizer_ref:
        tokenizer = load_model_by_name_tokenizer(str(tokenizer_ref)) or AutoTokenizer.from_pretrained(tokenizer_ref)
    if vision:
        if tokenizer is None:
            raise ModelLoadError("model.config: a vision-language model needs a `tokenizer` (e.g. headlab-tiny)")
        tokens = vision_tokens_for_config(model_type)
        tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)}, replace_extra_special_tokens=False)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tokens}
        if model_type.startswith("qwen2"):
            for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                               ("vision_start_token_id", "<|vision_start|>"),
                               ("vision_end_token_id", "<|vision_end|>")):
                cfg.setdefault(key, ids[token])
        else:
            cfg.setdefault("image_token_index" if model_type == "llava" else "image_token_id", ids[tokens[0]])
        text = dict(cfg.get("text_config") or {})
        text.setdefault("vocab_size", len(tokenizer))
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            text.setdefault(key, getattr(tokenizer, key, None))
        cfg["text_config"] = text
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"model.config: {e}") from None
    check_architecture(config, spec.name)
    check_vocabulary(tokenizer, config, spec.name)
    torch.manual_seed(seed)
    dtype = DTYPES.get(spec.dtype, torch.float32)
    auto_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    try:
        model = auto_class.from_config(config, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"model.config: cannot build a {model_type} model: {type(e).__name__}: {e}") from None
    digest = state_digest(model)  # before placement: weights offloaded to disk are not in memory afterwards
    if spec.device_map is None:
        model.to(device)
    else:
        model = _dispatch(model, spec)
        device = input_device(model)
    model.eval()
    processor = None
    if vision:
        try:
            processor = processor_for_config(model_type, config, tokenizer, processor_options)
        except (ValueError, TypeError) as e:
            raise ModelLoadError(str(e) if str(e).startswith("model.config") else f"model.config.processor: {e}") \
                from None
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec.name, geometry=geometry_of(model),
                       digest=digest, device=device, dtype=spec.dtype, processor=processor)


def load_model_by_name_tokenizer(name: str) -> Any | None:
    """The tokenizer of a registered model name, or None if ``name`` is not registered."""

    comp = get_manager().components["models"].get(name)
    if comp is None:
        return None
    return comp.impl(ModelSpec(id=name, device="cpu")).tokenizer


def load_model(spec: ModelSpec, seed: int = 0) -> LoadedModel:
    """Load the model a spec names: registered name, local path, hub id, or random from config."""

    if spec.config is not None:
        return from_config(spec, seed)
    ref = spec.path or spec.id
    assert ref is not None
    comp = get_manager().components["models"].get(ref)
    if comp is not None:
        lm = comp.impl(spec)
        check_architecture(lm.model.config, lm.name)
        check_vocabulary(lm.tokenizer, lm.model.config, lm.name, rows=embedding_rows(lm.model))
        return lm
    if spec.path is not None and not Path(spec.path).expanduser().exists():
        raise ModelLoadError(f"model path '{spec.path}' does not exist")
    local = Path(ref).expanduser()
    return from_pretrained(str(local) if local.exists() else ref, spec)
