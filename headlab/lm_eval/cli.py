"""The command-line entry: ``headlab eval`` (lm-eval's own command line with ``--model headlab``), and the
registration of :class:`HeadlabLM` as ``headlab`` in lm-eval's model registry."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from .adapter import HAVE_LM_EVAL, HeadlabLM, require_lm_eval

if HAVE_LM_EVAL:
    import lm_eval.models  # noqa: F401  (lm-eval registers its models lazily on first lookup of an empty registry)
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.api.registry import model_registry

__all__ = ["main"]


log = logging.getLogger("headlab.lm_eval")


def main(argv: Sequence[str] | None = None) -> None:
    """``headlab eval ARGS``: lm-eval's command line (``lm-eval run``) with ``--model headlab`` by default."""
    require_lm_eval()
    args = list(sys.argv[1:] if argv is None else argv)
    commands = ("run", "ls", "validate")
    if not args or args[0] not in commands:
        args = ["run", *args]
    if args[0] == "run" and not any(a in ("--model", "-M") or a.startswith("--model=") for a in args):
        args[1:1] = ["--model", "headlab"]
    saved = sys.argv
    sys.argv = ["headlab eval", *args]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


def _register() -> None:
    """Register :class:`HeadlabLM` as ``headlab`` in lm-eval's model registry (after lm-eval's own models)."""
    if model_registry.get("headlab", None) is not HeadlabLM:
        try:
            model_registry.register("headlab")(HeadlabLM)
        except ValueError as e:  # another class took the name (a reloaded module)
            log.warning("lm-eval model 'headlab' not registered: %s", e)


if HAVE_LM_EVAL:
    _register()
