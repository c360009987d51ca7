"""headlab.kernels: attention with per-head edits and streaming probes (Triton on CUDA, torch elsewhere).

The kernels know nothing of plugins or of transformers; see :func:`attention`, :func:`choose_backend`
(the one place that decides which path computes a call) and docs/kernels.md.
"""

from .attention import (
    BACKENDS,
    PAIR_PATHS,
    AttentionStats,
    HeadEdits,
    ProbeRequest,
    attention,
    choose_backend,
    needs_grad,
    pairs_from_csr,
    triton_available,
)

__all__ = ["BACKENDS", "PAIR_PATHS", "AttentionStats", "HeadEdits", "ProbeRequest", "attention",
           "choose_backend", "needs_grad", "pairs_from_csr", "triton_available"]
