"""The contract a step's result meets before the runner stores it, and the fields of a task's examples.

:func:`result_problems` checks a step's dataset as its action (or detector) returned it: every dimension is
one of :data:`headlab.DIMENSIONS`, the ``layer``/``head``/``kv_head`` axes fit the model and ``example`` the
task, scores over heads are neither NaN everywhere nor infinite, and every variable has a dtype a zarr store
holds (numbers, booleans, strings). :func:`meta_problem` checks the ``meta`` fields of a task's examples
before the step runs: one type per field, integers that fit 64 bits.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from .dims import DIMENSIONS

__all__ = ["OutOfMemory", "StoreWriteError", "meta_problem", "result_problems"]

class OutOfMemory(MemoryError):
    """A step ran out of host or GPU memory: the size that failed and the knobs that make it fit (the original
    error is its ``__cause__``)."""


class StoreWriteError(OSError):
    """Writing a cell into its run store failed (no space left, a file-size limit, a read-only file system, a
    name too long): the path, advice that fits the errno (:func:`write_advice`) and the command that finishes
    the run. A store the user placed where nothing can be written (read-only, not permitted, a name too long) is
    invalid input (exit code 2, :attr:`invalid`); a full disk is a failed run (1)."""

    def __str__(self) -> str:
        return str(self.strerror)

    @property
    def invalid(self) -> bool:
        """Whether the place the user chose cannot hold a store (the command exits 2, not 1)."""
        return self.errno in _WRONG_PLACE or self.errno == errno.ENAMETOOLONG


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", -1), errno.EFBIG}
_WRONG_PLACE = {errno.EROFS, errno.EACCES, errno.EPERM}


def write_advice(code: int | None, *, created: bool) -> str:
    """What to do about an ``OSError`` with errno ``code`` while writing a run store: free space or raise the
    limit (a full disk, a quota, a file-size limit), choose a writable ``--out`` (a read-only file system, no
    permission), a shorter ``--out`` path (a name too long), else the errno named. ``created``: whether the
    store exists (its cells are finished with ``--resume`` in place), or was being created (run again)."""
    if code == errno.EFBIG:
        return "raise the file-size limit (ulimit -f) or free space"
    if code == getattr(errno, "EDQUOT", -1):
        return "free space (or raise the disk quota)"
    if code in _FULL:
        return "free space (or raise the file-size limit)"
    if code in _WRONG_PLACE:
        return ("make the store writable again" if created else
                "choose a writable --out (or the spec's output:)")
    if code == errno.ENAMETOOLONG:
        return "choose a shorter --out path (or the spec's output:; at most 255 bytes a part)"
    name = errno.errorcode.get(code, "") if code is not None else ""
    return f"the system said errno {code}{f' ({name})' if name else ''} while writing; fix that"


INT64 = (-(2**63), 2**63 - 1)
"""The integers a stored variable (and an example's meta field) holds."""


def _kind(value: Any) -> str:
    """A meta value's storable kind: ``bool``, ``int``, ``float``, ``str`` or ``""`` (not a stored scalar)."""
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    if isinstance(value, (str, np.str_)):
        return "str"
    return ""


def meta_problem(key: str, values: Sequence[Any]) -> str | None:
    """Why the meta field ``key`` with one value per example (in order) cannot be stored, or None.

    Numbers of both kinds combine (as floats), booleans and strings stand alone; an integer must fit 64 bits.
    A field whose values are not all scalars is not stored at all (None)."""
    kinds = [_kind(v) for v in values]
    if not values or "" in kinds:
        return None
    for i, (v, k) in enumerate(zip(values, kinds, strict=True)):
        if k == "int" and not INT64[0] <= int(v) <= INT64[1]:
            return (f"meta field {key!r} of example {i} is {int(v)}, an integer beyond 64 bits, which a run store "
                    "cannot hold; give it as a string")
    groups = {"bool": "bool", "int": "number", "float": "number", "str": "str"}
    first = groups[kinds[0]]
    for i, k in enumerate(kinds):
        if groups[k] != first:
            return (f"meta field {key!r} mixes types: {kinds[0]} in example 0, {k} in example {i} "
                    f"({values[i]!r}); a stored field has one type: make every value a {kinds[0]} (or quote them "
                    "all as strings)")
    return None


def _object_problem(values: np.ndarray) -> str | None:
    """Why an object array cannot be stored (zarr holds object arrays of strings only), or None."""
    for v in values.ravel():
        if not isinstance(v, (str, np.str_)):
            return f"holds {type(v).__name__} values ({_short(v)}); a stored variable holds numbers, booleans or strings"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _axis_problem(ds: xr.Dataset, dim: str, size: int, what: str) -> str | None:
    if dim not in ds.dims:
        return None
    n = int(ds.sizes[dim])
    if dim in ds.coords:
        labels = np.asarray(ds.coords[dim].values)
        if labels.dtype.kind not in "iu" or len(set(labels.tolist())) != n or \
                (n and (labels.min() < 0 or labels.max() >= size)):
            return (f"dimension {dim!r} has labels {_short(labels.tolist())}; they must be distinct {what} indices "
                    f"in 0..{size - 1}")
        return None
    if n != size:
        return f"dimension {dim!r} has size {n}, but {what}s number {size} (without labels it must cover them all)"
    return None


def result_problems(ds: xr.Dataset, geometry: Any, n_examples: int | None) -> list[str]:
    """What is wrong with a step's result ``ds`` for a model of ``geometry`` (``n_examples``: the task's
    examples when ``ds``'s ``example`` axis is theirs, else None), as phrases naming the variable."""
    problems: list[str] = []
    unknown = sorted({str(d) for var in ds.variables.values() for d in var.dims} - set(DIMENSIONS))
    for dim in unknown:
        holders = sorted(str(name) for name, var in ds.variables.items() if dim in var.dims)
        problems.append(f"variable {holders[0]!r} has dimension {dim!r}, which is not one of headlab.DIMENSIONS "
                        f"({', '.join(sorted(DIMENSIONS)[:6])}, ...)")
    for dim, size, what in (("layer", geometry.n_layers, "layer"), ("head", geometry.n_heads, "head"),
                            ("kv_head", geometry.n_kv_heads, "kv head"),
                            ("example", n_examples, "example")):
        if size is None:
            continue
        problem = _axis_problem(ds, dim, int(size), what)
        if problem:
            holders = sorted(str(name) for name, var in ds.data_vars.items() if dim in var.dims) or [dim]
            problems.append(f"variable {holders[0]!r}: {problem} (this model has {geometry.n_layers} layers x "
                            f"{geometry.n_heads} heads)" if dim != "example" else f"variable {holders[0]!r}: {problem}")
    for name, var in ds.variables.items():
        kind = var.dtype.kind
        if kind == "O":
            problem = _object_problem(np.asarray(var.values))
            if problem:
                problems.append(f"variable {str(name)!r} {problem}")
        elif kind not in "biufcUSMm":
            problems.append(f"variable {str(name)!r} has dtype {var.dtype}, which a run store cannot hold")
        elif kind == "f" and "layer" in var.dims and "head" in var.dims and var.size:
            values = np.asarray(var.values)
            if np.isinf(values).any():
                problems.append(f"variable {str(name)!r} is infinite for some heads; scores over heads are finite "
                                "(NaN marks a head that could not be scored)")
            elif np.isnan(values).all():
                problems.append(f"variable {str(name)!r} is NaN for every head: nothing was scored")
    return problems
