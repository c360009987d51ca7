"""SnapKV's selection: the prompt keys each KV head keeps after a prefill, within its budget (HeadKV)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from .errors import KvPolicyError

__all__ = ["snapkv_keep"]


def snapkv_keep(keys: torch.Tensor, queries: torch.Tensor, budget: Sequence[int] | torch.Tensor, *,
                kernel_size: int = 7, pooling: Literal["max", "avg"] = "max", pad: Sequence[int] | torch.Tensor | None = None,
                scaling: float | None = None) -> list[torch.Tensor]:
    """The keys each KV head of one layer keeps after the prefill, SnapKV-style (Li et al. 2024, as HeadKV
    uses it): the positions of its ``budget[j] - W`` highest-scoring keys before the observation window plus
    the window's ``W`` own tokens.

    ``keys`` ``[batch, n_kv_heads, seq, head_dim]`` are the layer's keys after prefill (left-padded rows;
    ``pad[b]`` padding tokens, default none) and ``queries`` ``[batch, n_heads, W, head_dim]`` its last ``W``
    queries (both after the rotary embedding); KV head ``j`` serves query heads ``j*g .. (j+1)*g - 1``. A
    key's score is the attention (softmax of ``scaling * q.k``, default ``1/sqrt(head_dim)``, over the row's
    keys causally) it receives, averaged over the window's queries (of the row's own tokens) and the KV head's
    query heads,
    then pooled over neighbouring positions (``pooling`` max or avg, width ``kernel_size``, over the keys
    before the window); ties go to the earlier position. A row with at most ``budget[j]`` tokens keeps them
    all. Returns, per KV head, the kept positions ``[batch, k]`` as indices into ``seq``, ascending, with
    -1 first where a row keeps fewer than the longest row."""
    if keys.dim() != 4 or queries.dim() != 4:
        raise KvPolicyError("keys are [batch, n_kv_heads, seq, head_dim] and queries [batch, n_heads, W, head_dim]")
    batch, n_kv, seq, dim = keys.shape
    n_heads, window = queries.shape[1], queries.shape[2]
    if queries.shape[0] != batch or queries.shape[-1] != dim or n_heads % n_kv:
        raise KvPolicyError(f"queries {tuple(queries.shape)} do not fit keys {tuple(keys.shape)}")
    if window > seq:
        raise KvPolicyError(f"an observation window of {window} queries over {seq} keys")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise KvPolicyError(f"kernel size {kernel_size}: an odd pooling width is needed")
    budgets = [int(b) for b in (budget.tolist() if isinstance(budget, torch.Tensor) else budget)]
    if len(budgets) != n_kv:
        raise KvPolicyError(f"{len(budgets)} budgets for {n_kv} KV heads")
    if any(b < window for b in budgets):
        raise KvPolicyError(f"a budget of {min(budgets)} tokens is below the observation window of {window}")
    device = keys.device
    pads = torch.zeros(batch, dtype=torch.long, device=device) if pad is None \
        else torch.as_tensor(pad, dtype=torch.long, device=device)
    group = n_heads // n_kv
    positions = torch.arange(seq, device=device)
    query_pos = torch.arange(seq - window, seq, device=device)
    visible = (positions[None, None, :] <= query_pos[None, :, None]) & (positions[None, None, :] >= pads[:, None, None])
    scale = dim**-0.5 if scaling is None else scaling
    # the query heads of a KV head against its keys, without repeating the keys per query head
    grouped = queries.float().reshape(batch, n_kv, group * window, dim)
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)).view(batch, n_kv, group, window, seq) * scale
    attn = torch.softmax(logits.masked_fill(~visible[:, None, None], float("-inf")), dim=-1)
    # a padding query sees no key (its row is NaN): it adds nothing; a row's mean and sum rank alike
    score = attn.nan_to_num(0.0).mean(dim=(2, 3))[..., : seq - window]
    if seq > window:
        flat = score.reshape(batch * n_kv, 1, seq - window)
        if pooling == "max":
            pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
        else:
            pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
        score = pooled.view(batch, n_kv, seq - window)
    real_key = positions[None, : seq - window] >= pads[:, None]  # (batch, seq - W)
    score = score.masked_fill(~real_key[:, None], float("-inf"))
    in_window = (positions[None, :] >= seq - window) & (positions[None, :] >= pads[:, None])
    out = []
    for head, head_budget in enumerate(budgets):
        keep = in_window.clone()
        picks = min(head_budget - window, seq - window)
        if picks > 0:
            order = torch.sort(score[:, head], dim=-1, descending=True, stable=True).indices[:, :picks]
            chosen = torch.zeros_like(keep)
            chosen.scatter_(1, order, True)
            keep |= chosen & torch.cat([real_key, torch.zeros_like(in_window[:, seq - window:])], dim=1)
        count = int(keep.sum(dim=1).max())
        ranked = torch.sort(torch.where(keep, positions[None, :], -1), dim=1).values
        out.append(ranked[:, seq - count:])
    return out
