"""How much of a head's attention follows a detection pattern: the scores of the pattern detectors
(docs/methods.md#pattern-detectors), for every component that reads attention against a pattern.

A detection pattern ``D`` (queries x keys, 0/1) is compared with a head's attention ``A``: ``mul`` scores
``sum(A * D) / sum(A)``, ``abs`` scores ``1 - sum|A - D| / n``; ``exclude_bos`` zeroes ``A[:, 0]``,
``exclude_current`` the diagonal. :func:`similarity` computes them from the full pattern ``A``;
:func:`pair_scores` computes the same numbers from probes (``Probes(pairs=..., spans=...)``: ``A`` at ``D``'s
ones, ``A[i, 0]`` and the row totals), without an ``n x n`` matrix.
"""

from __future__ import annotations

import torch

__all__ = ["pair_scores", "similarity"]


def similarity(pattern: torch.Tensor, det: torch.Tensor, measure: str, exclude_bos: bool,
               exclude_current: bool) -> torch.Tensor:
    """Scores of attention patterns ``(..., n, n)`` against ``det`` ``(n, n)``; returns ``(...)``."""
    a = pattern.clone().double()
    det = det.double()
    n = a.shape[-1]
    eye = torch.eye(n, dtype=torch.bool)
    if measure == "mul":
        if exclude_bos:
            a[..., :, 0] = 0
        if exclude_current:
            a = a.masked_fill(eye, 0)
        return (a * det).sum((-1, -2)) / a.sum((-1, -2))
    diff = (a - det).abs()
    if exclude_bos:
        diff[..., :, 0] = 0
    if exclude_current:
        diff = diff.masked_fill(eye, 0)
    return 1 - diff.sum((-1, -2)) / n


def pair_scores(pair_mass: torch.Tensor, pairs: torch.Tensor, bos_mass: torch.Tensor, row_mass: torch.Tensor,
                measure: str, exclude_bos: bool, exclude_current: bool,
                diag_mass: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`similarity` from probes instead of the pattern ``A`` (n x n); returns ``(...)``.

    ``pairs`` (P, 2): the distinct ``(query, key)`` ones of ``D``; ``pair_mass`` (..., P): ``A`` at them;
    ``bos_mass`` (..., n): ``A[i, 0]``; ``row_mass`` (..., n): ``sum_j A[i, j]`` (1, or 0 for a padding
    query); ``diag_mass`` (..., n): ``A[i, i]``, needed when ``exclude_current``.

    With ``sum(A∘D)`` the sum of the pair masses and the excluded cells ``E`` (column 0, the diagonal,
    ``(0, 0)`` counted once where they meet): ``mul`` = ``(sum(A∘D) - sum_E A·D) / (sum(A) - sum_E A)``;
    ``abs`` = ``1 - (sum|A-D| - sum_E |A-D|) / n`` with ``sum|A-D| = sum(A) + sum(D) - 2 sum(A∘D)`` and
    ``sum_E |A-D| = sum_E A + |E ∩ D| - 2 sum_E A·D`` (A in [0, 1], D in {0, 1}). As in :func:`similarity`,
    the exclusions remove cells of ``A`` under ``mul`` and cells of ``|A - D|`` under ``abs``.
    """
    m = pair_mass.double()
    pairs = torch.as_tensor(pairs).long().reshape(-1, 2)
    n = bos_mass.shape[-1]
    if m.shape[-1] != pairs.shape[0]:
        raise ValueError(f"pair_mass {tuple(m.shape)} does not match {pairs.shape[0]} pairs")
    q, k = pairs[:, 0], pairs[:, 1]
    a_d = m.sum(-1)  # sum(A ∘ D)
    total = row_mass.double().sum(-1)  # sum(A)
    bos = bos_mass.double()
    zero = torch.zeros_like(total)
    ex_a, ex_ad, ex_n = zero, zero, 0  # over the excluded cells: sum of A, of A·D, and |E ∩ D|

    def on(sel: torch.Tensor) -> torch.Tensor:
        return m[..., sel].sum(-1)

    if exclude_bos:
        ex_a, ex_ad, ex_n = ex_a + bos.sum(-1), ex_ad + on(k == 0), ex_n + int((k == 0).sum())
    if exclude_current:
        if diag_mass is None:
            raise ValueError("exclude_current needs diag_mass (A[i, i])")
        ex_a, ex_ad, ex_n = ex_a + diag_mass.double().sum(-1), ex_ad + on(q == k), ex_n + int((q == k).sum())
    if exclude_bos and exclude_current:  # (0, 0) is both the first column and the diagonal: count it once
        both = (q == 0) & (k == 0)
        ex_a, ex_ad, ex_n = ex_a - bos[..., 0], ex_ad - on(both), ex_n - int(both.sum())
    if measure == "mul":
        return (a_d - ex_ad) / (total - ex_a)
    ex_abs = ex_a + ex_n - 2 * ex_ad
    return 1 - (total + pairs.shape[0] - 2 * a_d - ex_abs) / n
