"""Where lm-eval's datasets are cached during a run: beside the run's store, unless the environment says."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..results import is_url, store_location

try:  # lm-eval installs it
    import datasets.config as datasets_config
except ImportError:  # pragma: no cover - lm-eval requires datasets
    datasets_config = None

__all__ = ["CACHE_ENV", "cache_directory", "datasets_cache"]


CACHE_ENV = ("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME")
"""Environment variables that name the ``datasets`` cache; when one is set, :func:`datasets_cache` leaves it."""


def cache_directory(store: str | Path) -> Path | None:
    """Where the ``evaluate`` steps of a run store cache datasets: ``.cache`` in the directory holding the store
    (the run's ``--out``), shared by its runs; None for a store that is not a local directory (a URL)."""

    location = store_location(store) if str(store) else ""
    if not location or is_url(location):
        return None
    return Path(location).parent / ".cache"


@contextmanager
def datasets_cache(directory: str | Path | None) -> Iterator[Path | None]:
    """While the block runs, the ``datasets`` library keeps what it prepares, downloads and extracts under
    ``directory/datasets`` (yielded) instead of ``~/.cache/huggingface/datasets``. Nothing changes (None is
    yielded) when ``directory`` is None or the environment names a cache (:data:`CACHE_ENV`)."""
    config = datasets_config
    if directory is None or config is None or any(os.environ.get(name) for name in CACHE_ENV):
        yield None
        return
    root = Path(directory).expanduser() / "datasets"
    paths = {"HF_DATASETS_CACHE": root, "DOWNLOADED_DATASETS_PATH": root / "downloads",
             "EXTRACTED_DATASETS_PATH": root / "downloads" / "extracted"}
    saved = {name: getattr(config, name) for name in paths}
    for name, path in paths.items():
        setattr(config, name, path)
    os.environ["HF_DATASETS_CACHE"] = str(root)  # for anything that reads the variable itself
    try:
        yield root
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
        os.environ.pop("HF_DATASETS_CACHE", None)
