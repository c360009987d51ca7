"""headlab.kernels: attention with per-head edits and streaming probes (Triton on CUDA, torch elsewhere).

The kernels know nothing of plugins or of transformers; see :func:`attention` and docs/kernels.md.
"""

from .attention import BACKENDS, AttentionStats, attention, triton_available

__all__ = ["BACKENDS", "AttentionStats", "attention", "triton_available"]
