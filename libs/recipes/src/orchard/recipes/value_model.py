"""A small value model: does a trajectory succeed, read from what the policy saw and did.

Features are a hashed bag of word n-grams of the trajectory's text, the observations (prompt,
tool results) and the actions (the model's outputs) hashed apart, so "passed" in a test run's
output and "passed" typed by the model are different features. Counts are log-scaled and each
trajectory's vector has unit length. The model is an L2-regularized logistic regression on
them, each class weighted to half of the loss (successes are often rare), fitted by
full-batch Nesterov gradient descent: no randomness, so the same history gives the same
weights.

Why this and not a neural model over token ids: the history is a few hundred trajectories. A
linear model over sparse n-grams has one weight per feature and a convex loss; it learns
from that little data what separates successes from failures (a test run that printed
"passed", a submit after an edit, a loop of the same command) and trains in a second or
two on a CPU, with numpy alone (this package installs without torch). Its score ranks
trajectories; with the classes balanced it is not a calibrated probability of success.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from orchard.types.v1 import trajectory_pb2

__all__ = [
    "FeatureSpace",
    "ValueModel",
    "auc",
    "fit_value_model",
    "split_by_task",
    "trajectory_text",
    "within_task_accuracy",
]

_WORD = re.compile(r"[a-z_]+|\d+|[^\sa-z_\d]")
MAX_WORDS = 20_000
"""Words of one trajectory's text read at most (its last ones: where it ended up)."""


def trajectory_text(trajectory: trajectory_pb2.Trajectory) -> list[tuple[str, str]]:
    """(kind, text) pieces of what the policy saw ("obs") and did ("act"), in order: each
    captured turn's new input and its output; without turns, the conversation's messages (the
    model's own as actions, every other role as observations)."""
    pieces: list[tuple[str, str]] = []
    for turn in trajectory.turns:
        if turn.input_text:
            pieces.append(("obs", turn.input_text))
        if turn.output_text:
            pieces.append(("act", turn.output_text))
    if pieces or not trajectory.conversation_json:
        return pieces
    try:
        messages = json.loads(trajectory.conversation_json)
    except json.JSONDecodeError:
        return pieces
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            continue
        text = message.get("content")
        text = text if isinstance(text, str) else json.dumps(text or "")
        for call in message.get("tool_calls") or []:
            text += "\n" + json.dumps(call.get("function", call), sort_keys=True)
        kind = "act" if message.get("role") == "assistant" else "obs"
        pieces.append((kind, f"{message.get('role', '')}: {text}"))
    return pieces


@lru_cache(maxsize=1 << 20)
def _bucket(feature: str, buckets: int) -> int:
    """A stable hash (the same in every process, unlike ``hash``) of ``feature`` into
    ``buckets``."""
    digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % buckets


@dataclass(frozen=True, slots=True)
class FeatureSpace:
    """How a trajectory becomes a sparse vector."""

    ngrams: int = 2
    """Longest n-gram of words."""
    buckets: int = 2**18
    """Size of the hashed space."""

    def features(self, trajectory: trajectory_pb2.Trajectory) -> dict[int, float]:
        """Bucket -> value: log(1 + count) of the n-grams hashed there, scaled to unit length;
        empty for a trajectory without text."""
        words: list[tuple[str, str]] = []
        for kind, text in trajectory_text(trajectory):
            words += [(kind, w) for w in _WORD.findall(text.lower())]
        words = words[-MAX_WORDS:]
        counts: Counter[int] = Counter()
        for n in range(1, self.ngrams + 1):
            for i in range(len(words) - n + 1):
                window = words[i : i + n]
                kind = window[-1][0]
                key = f"{kind}:{n}:" + " ".join(w for _, w in window)
                counts[_bucket(key, self.buckets)] += 1
        values = {b: math.log1p(c) for b, c in counts.items()}
        norm = math.sqrt(sum(v * v for v in values.values()))
        return {b: v / norm for b, v in values.items()} if norm else {}


@dataclass(frozen=True)
class _Sparse:
    """Rows of sparse vectors (CSR): what the gradient steps multiply by."""

    indptr: npt.NDArray[np.int64]
    indices: npt.NDArray[np.int64]
    data: npt.NDArray[np.float64]
    width: int

    @classmethod
    def of(cls, rows: Sequence[Mapping[int, float]], width: int) -> _Sparse:
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        indptr[1:] = np.cumsum([len(r) for r in rows])
        indices = np.fromiter((i for r in rows for i in sorted(r)), np.int64, int(indptr[-1]))
        data = np.fromiter((r[i] for r in rows for i in sorted(r)), np.float64, int(indptr[-1]))
        return cls(indptr, indices, data, width)

    @property
    def rows(self) -> int:
        return len(self.indptr) - 1

    def dot(self, weights: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """X @ weights."""
        products = self.data * weights[self.indices]
        out = np.zeros(self.rows)
        nonempty = self.indptr[:-1] < self.indptr[1:]
        out[nonempty] = np.add.reduceat(products, self.indptr[:-1][nonempty])
        return out

    def transpose_dot(self, values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """X.T @ values."""
        per_entry = np.repeat(values, np.diff(self.indptr)) * self.data
        summed = np.bincount(self.indices, weights=per_entry, minlength=self.width)
        return summed.astype(np.float64)


@dataclass(frozen=True)
class ValueModel:
    """A fitted logistic regression over a `FeatureSpace`."""

    space: FeatureSpace
    weights: npt.NDArray[np.float64]
    bias: float

    def scores(self, trajectories: Sequence[trajectory_pb2.Trajectory]) -> list[float]:
        """Each trajectory's predicted success in (0, 1): higher is likelier to succeed."""
        if not trajectories:
            return []
        rows = _Sparse.of([self.space.features(t) for t in trajectories], self.space.buckets)
        margins = rows.dot(self.weights) + self.bias
        return [float(v) for v in 1.0 / (1.0 + np.exp(-np.clip(margins, -50, 50)))]

    def save(self, path: Any) -> None:
        """The model's nonzero weights as a compressed ``.npz``, for people to load."""
        used = np.flatnonzero(self.weights)
        np.savez_compressed(
            path,
            buckets=self.space.buckets,
            ngrams=self.space.ngrams,
            bias=self.bias,
            indices=used,
            weights=self.weights[used],
        )


def fit_value_model(
    trajectories: Sequence[trajectory_pb2.Trajectory],
    labels: Sequence[bool],
    *,
    space: FeatureSpace = FeatureSpace(),
    l2: float = 1e-3,
    iterations: int = 400,
) -> ValueModel:
    """Fit the model to ``labels`` (success of each trajectory). Raises ValueError without
    both a success and a failure: nothing can be learned from one class."""
    if len(trajectories) != len(labels):
        raise ValueError(f"{len(trajectories)} trajectories for {len(labels)} labels")
    successes = sum(bool(y) for y in labels)
    failures = len(labels) - successes
    if not successes or not failures:
        raise ValueError(
            f"a value model needs successes and failures to learn from; the history has "
            f"{successes} success(es) and {failures} failure(s)"
        )
    full = _Sparse.of([space.features(t) for t in trajectories], space.buckets)
    # Buckets no trajectory fills keep a weight of 0 (their gradient is 0): fit in the space of
    # the filled ones, far smaller.
    used, compact = np.unique(full.indices, return_inverse=True)
    rows = _Sparse(full.indptr, compact.astype(np.int64), full.data, len(used))
    y = np.array([1.0 if v else -1.0 for v in labels])
    # Each class carries half of the loss.
    share = np.where(y > 0, 0.5 / successes, 0.5 / failures)
    # The loss's gradient is Lipschitz with constant at most 0.25 * (|x|^2 + 1) + l2 (unit rows
    # plus the bias), so a step of 1 / (0.5 + l2) never overshoots.
    step = 1.0 / (0.5 + l2)
    weights = np.zeros(len(used))
    bias = 0.0
    ahead_w, ahead_b = weights.copy(), bias
    for i in range(iterations):
        margins = y * (rows.dot(ahead_w) + ahead_b)
        pull = -share * y / (1.0 + np.exp(np.clip(margins, -50, 50)))
        grad_w = rows.transpose_dot(pull) + l2 * ahead_w
        grad_b = float(pull.sum())
        next_w = ahead_w - step * grad_w
        next_b = ahead_b - step * grad_b
        momentum = i / (i + 3)
        ahead_w = next_w + momentum * (next_w - weights)
        ahead_b = next_b + momentum * (next_b - bias)
        weights, bias = next_w, next_b
    spread = np.zeros(space.buckets)
    spread[used] = weights
    return ValueModel(space, spread, bias)


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Area under the ROC curve: the chance a random success scores above a random failure
    (a tie counts half); None without both classes."""
    positives = [s for s, y in zip(scores, labels, strict=True) if y]
    negatives = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not positives or not negatives:
        return None
    ranked = sorted(negatives)
    wins = 0.0
    for p in positives:
        below = _count_below(ranked, p)
        equal = _count_below(ranked, p, inclusive=True) - below
        wins += below + 0.5 * equal
    return wins / (len(positives) * len(negatives))


def _count_below(ranked: Sequence[float], value: float, *, inclusive: bool = False) -> int:
    lo, hi = 0, len(ranked)
    while lo < hi:
        mid = (lo + hi) // 2
        if ranked[mid] < value or (inclusive and ranked[mid] == value):
            lo = mid + 1
        else:
            hi = mid
    return lo


def within_task_accuracy(
    groups: Iterable[Sequence[tuple[float, bool]]],
) -> tuple[float | None, int]:
    """Over every pair of attempts at the same task where one succeeded and the other failed:
    the share where the success scored higher (a tie counts half), and how many such pairs
    there were (None when there were none). What best-of-k depends on: the ranking within a
    task, not across tasks."""
    wins = 0.0
    pairs = 0
    for attempts in groups:
        for s_score, s_won in attempts:
            if not s_won:
                continue
            for f_score, f_won in attempts:
                if f_won:
                    continue
                pairs += 1
                wins += 1.0 if s_score > f_score else 0.5 if s_score == f_score else 0.0
    return (wins / pairs if pairs else None), pairs


def split_by_task(task_ids: Sequence[str], fraction: float, seed: int) -> set[str]:
    """The tasks held out for validation: ``fraction`` of the distinct ``task_ids`` (at least
    one, never all), drawn with ``seed``; empty with fewer than two tasks. Whole tasks, so no
    attempt at a validation task is trained on."""
    tasks = sorted(set(task_ids))
    if len(tasks) < 2:
        return set()
    random.Random(seed).shuffle(tasks)
    count = min(len(tasks) - 1, max(1, round(fraction * len(tasks))))
    return set(tasks[:count])
