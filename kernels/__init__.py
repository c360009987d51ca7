"""headlab.kernels: attention with per-head edits and streaming probes (Triton on CUDA, torch elsewhere).

The kernels know nothing of plugins or of transformers; see :func:`attention`, :func:`choose_backend`
(the one place that decides which path computes a call) and docs/kernels.md.
"""

from .attention import (
    BACKENDS,
    AttentionStats,
    HeadEdits,
    ProbeRequest,
    attention,
    choose_backend,
    triton_available,
)

__all__ = ["BACKENDS", "AttentionStats", "HeadEdits", "ProbeRequest", "attention", "choose_backend",
           "triton_available"]
