"""headlab's version, read from its installed metadata (a leaf: it imports nothing of headlab)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("headlab")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"
