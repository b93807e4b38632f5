"""Evaluation metrics, computed as gaps' built-in evaluation computes them."""

from __future__ import annotations

import numpy as np

from . import ShapeError, _gaps, _native

__all__ = ["auc", "logloss"]


def auc(scores, labels) -> float:
    """Area under the ROC curve of ``scores`` for 0/1 ``labels`` (ties counted half)."""
    s = np.ascontiguousarray(np.asarray(scores, dtype=np.float32).reshape(-1), dtype="<f4")
    y = np.ascontiguousarray(np.asarray(labels, dtype=np.float32).reshape(-1), dtype="<f4")
    if s.shape != y.shape:
        raise ShapeError(f"scores and labels differ in length: {s.size} and {y.size}")
    return float(_native(_gaps.auc, s.tobytes(), y.tobytes()))


def logloss(probabilities, labels, *, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of ``probabilities`` for 0/1 ``labels`` (clipped to [eps, 1 - eps])."""
    p = np.clip(np.asarray(probabilities, dtype=np.float64).reshape(-1), eps, 1 - eps)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    if p.shape != y.shape:
        raise ShapeError(f"probabilities and labels differ in length: {p.size} and {y.size}")
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
