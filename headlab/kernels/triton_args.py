"""The arguments of the Triton attention kernels (:mod:`.triton_attention`), bundled in named tuples: triton >= 3.3
takes tuples as arguments, named ones too. :class:`ScoreFlags`, :class:`OutputFlags` and :class:`Blocks` are
``tl.constexpr``: their fields compile code in or out. Plain Python, no triton: the kernels' module is reloaded
under ``TRITON_INTERPRET=1`` by the tests, these stay.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["Blocks", "Dims", "Edits", "Masks", "OutputFlags", "Pairs", "Probes", "ScoreFlags", "Strides"]


class Strides(NamedTuple):
    """(batch, head, position, dim) strides of q, k, v, the output and the general mask (head stride 0 when
    one mask serves every head), and the batch stride of the key padding mask."""

    q: tuple
    k: tuple
    v: tuple
    o: tuple
    am: tuple
    kpm: int


class Edits(NamedTuple):
    """The head edits as kernel inputs: (B, H) query multiplier ``scale * q_scale``, (B, H) int8 score-zero
    flags, (B, H) output scales, (B, S, 2) int32 key spans with their (B, H, S) float32 biases."""

    QMUL: Tensor
    SZ: Tensor
    OSC: Tensor
    KSPAN: Tensor
    KBIAS: Tensor


class Masks(NamedTuple):
    """(B, Nk) int8 key padding mask and (B, H|1, Nq, Nk) int8 general mask."""

    KPM: Tensor
    AM: Tensor


class Probes(NamedTuple):
    """Probe inputs, (B, P, 2) int32 spans and (B, O) int32 offsets, and the buffers of one row per (batch
    row, head, query) (per key split: partial state): argmax index and score, entropy (or its running sum
    ``F``), span masses, offset masses; the (B, H, Nq, Nk) pattern; the rows' (max, normaliser); a split's
    unnormalised output."""

    PSPAN: Tensor
    POFF: Tensor
    ARGI: Tensor
    ARGS: Tensor
    FENT: Tensor
    SPM: Tensor
    OFM: Tensor
    PAT: Tensor
    ML: Tensor
    ACC: Tensor


class Dims(NamedTuple):
    """Sizes: query heads, query heads per kv head, queries, keys, head dims of q/k and v, key spans, probe
    spans, probe offsets."""

    H: int
    G: int
    Nq: int
    Nk: int
    D: int
    Dv: int
    NKS: int
    NPS: int
    NOS: int


class Pairs(NamedTuple):
    """Flat pair probes: row ``b``, query ``i``, key ``j`` and output slot of each (n,) pair, ``n``, and the
    slots per row of the (B, H, slots) output."""

    FB: Tensor
    FQ: Tensor
    FK: Tensor
    FP: Tensor
    n: int
    slots: int


class ScoreFlags(NamedTuple):
    """How a score is computed (``tl.constexpr``: each flag compiles its code in or out): score zeroing, key
    biases, key padding, general mask, causal, window, softcap, IEEE float32 dots."""

    HAS_SZ: bool
    HAS_KB: bool
    HAS_KPM: bool
    HAS_AM: bool
    CAUSAL: bool
    HAS_WINDOW: bool
    HAS_SOFTCAP: bool
    IEEE: bool


class OutputFlags(NamedTuple):
    """What a program accumulates and writes (``tl.constexpr``): output scales, argmax, entropy, span and
    offset masses, the pattern, partial state of a key split, the rows' (max, normaliser) for the pair
    kernel."""

    HAS_OS: bool
    PROBE_ARGMAX: bool
    PROBE_ENT: bool
    HAS_PS: bool
    HAS_PO: bool
    RETURN_PATTERN: bool
    SPLIT: bool
    STORE_ML: bool


class Blocks(NamedTuple):
    """Tile sizes (``tl.constexpr``): queries, keys, head dims of q/k and v, key spans, probe spans, offsets."""

    M: int
    N: int
    D: int
    DV: int
    S: int
    P: int
    O: int  # noqa: E741
