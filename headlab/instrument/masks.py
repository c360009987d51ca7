"""Attention masks: the one headlab registers with transformers, and its translation to kernel arguments."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headlab.kernels.attention import visibility
from headlab.kv.layers import mask_stays_implicit

from .layers import UnsupportedModelError

__all__ = ["kernel_mask_args", "mask_function"]


def mask_function(*args: Any, **kwargs: Any) -> Any:
    """The mask handed to headlab attention: exactly what transformers builds for SDPA, except under a KV
    policy whose split attention rebuilds the plain causal mask from the cache (None then, no dense mask)."""
    from transformers.masking_utils import sdpa_mask

    if not args and mask_stays_implicit(kwargs.get("mask_function"), kwargs.get("attention_mask"), kwargs.get("q_length"),
                                   kwargs.get("kv_length"), kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)):
        return None
    return sdpa_mask(*args, **kwargs)


def kernel_mask_args(mask: Tensor | None, Nq: int, Nk: int, causal: bool, window: int | None) -> dict:
    """Kernel mask arguments from transformers' mask: the 4-D boolean SDPA mask is compressed to
    (key padding, causal, window) when it is exactly that, else passed on as a general ``attn_mask``."""
    if mask is None:
        return dict(key_padding_mask=None, attn_mask=None, causal=causal, window=window)
    if mask.dtype != torch.bool:
        finfo_min = torch.finfo(mask.dtype).min
        if not bool(((mask == 0) | (mask <= finfo_min / 2)).all()):
            raise UnsupportedModelError("headlab: additive float attention masks with biases are not supported")
        mask = mask == 0
    if mask.dim() != 4:
        raise UnsupportedModelError(f"headlab: unexpected attention mask of shape {tuple(mask.shape)}")
    if mask.shape[-1] != Nk:
        mask = mask[..., :Nk]
    if mask.shape[1] == 1 and mask.shape[2] == Nq:
        kpm = mask.any(dim=2)[:, 0]  # (B, Nk): keys some query sees
        for cand_window, cand_causal in ((window, causal), (None, causal), (window, True), (None, True)):
            if _mask_is(mask, kpm, cand_causal, cand_window):
                return dict(key_padding_mask=None if bool(kpm.all()) else kpm, attn_mask=None,
                            causal=cand_causal, window=cand_window)
    # a general mask (e.g. static-cache slots, bidirectional image blocks)
    return dict(key_padding_mask=None, attn_mask=mask, causal=False, window=None)


def _mask_is(mask: Tensor, kpm: Tensor, causal: bool, window: int | None) -> bool:
    """Whether the (B, 1, Nq, Nk) boolean ``mask`` is exactly key padding ``kpm`` (B, Nk) and the causal /
    window visibility; compared a band of query rows at a time, so the check adds O(rows x Nk) memory to the
    mask's own, never another (Nq, Nk) one."""
    B, _, Nq, Nk = mask.shape
    if not causal and window is None and Nq != 1:
        return False  # such a mask is no visibility pattern (and the check never accepted it)
    rows = max(1, (1 << 22) // max(1, B * Nk))
    for q0 in range(0, Nq, rows):
        q1 = min(Nq, q0 + rows)
        vis = visibility(Nq, Nk, q0, q1, 0, Nk, causal, window, mask.device)
        expect = kpm[:, None, None, :] if vis is None else vis[None, None] & kpm[:, None, None, :]
        if not torch.equal(mask[:, :, q0:q1], expect):
            return False
    return True
