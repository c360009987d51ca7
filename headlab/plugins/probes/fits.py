"""The per-head logistic fits of the ``probe`` detector, in a module of their own: joblib's worker processes
import it to run them, and it loads only numpy (sklearn when a fit runs), not torch or headlab, so a worker
starts in about a second."""

from __future__ import annotations

import numpy as np

__all__ = ["fit_logistic", "unit"]


def unit(v: np.ndarray) -> np.ndarray:
    """``v`` scaled to length 1 (a zero vector stays zero)."""
    n = np.linalg.norm(v)
    return v / n if n > 0 else v


def fit_logistic(X: np.ndarray, y: np.ndarray, fold: np.ndarray, n_folds: int, C: float,
                 positive: int, solver: str) -> tuple[np.ndarray, np.ndarray]:
    """Held-out accuracy per fold and the unit probe direction (positive vs rest, all examples) of one head."""
    from sklearn.linear_model import LogisticRegression

    acc = np.empty(n_folds)
    for k in range(n_folds):
        train, test = fold != k, fold == k
        clf = LogisticRegression(C=C, max_iter=1000, solver=solver).fit(X[train], y[train])
        acc[k] = float((clf.predict(X[test]) == y[test]).mean())
    refit = LogisticRegression(C=C, max_iter=1000, solver=solver).fit(X, (y == positive).astype(np.int64))
    return acc, unit(refit.coef_[0])
