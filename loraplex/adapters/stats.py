"""Counters of one adapter tier (host memory or slots): hits, misses, evictions and load latency."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def percentile(values, q: float) -> float | None:
    """The q-quantile (0..1) of `values` by the nearest rank below, None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class TierStats:
    """Counts since start; `load_s` the seconds of the last 1,024 loads into the tier."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    load_s: deque = field(default_factory=lambda: deque(maxlen=1024))

    def summary(self, capacity: int | None, used: int) -> dict:
        return {"capacity": capacity, "used": used, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "load_s_p50": percentile(self.load_s, 0.5),
                "load_s_p99": percentile(self.load_s, 0.99)}
