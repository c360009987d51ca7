"""The error of the KV-cache package: a policy that cannot be compiled or applied."""

from __future__ import annotations

__all__ = ["KvPolicyError"]


class KvPolicyError(ValueError):
    """A KV policy cannot be compiled or applied (bad head file, budget, geometry, padding)."""
