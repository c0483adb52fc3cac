"""Decaying exponential histograms, as koordlet's ``pkg/util/histogram`` (from the VPA).

Buckets grow geometrically: bucket ``i`` starts at ``first * (ratio**i - 1) / (ratio - 1)``
(``first`` is the first bucket's width), up to a bucket holding ``max_value``; values
above land in the last bucket. A sample's weight is multiplied by
``2 ** ((t - reference) / half_life)``, so a sample one half-life older counts half as
much; the reference moves forward (all weights rescaled) before the factors overflow.

``percentile(p)`` is the END of the first bucket at which the cumulative weight reaches
``p`` of the total (the start of the last bucket if that is where it lands): an upper
bound, never below the samples it stands for. A histogram whose total weight is below
``epsilon`` is empty and answers 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

#: Rescale weights once the decay exponent reaches this (2**100 is far from overflow).
_MAX_DECAY_EXPONENT: Final = 100


@dataclass(frozen=True, slots=True)
class BucketOptions:
    """Exponential bucket boundaries: ``first`` (first bucket's width), ``ratio`` (growth),
    ``max_value`` (values above go into the last bucket), ``epsilon`` (the weight below which
    a histogram or a bucket counts as empty)."""

    max_value: float
    first: float
    ratio: float
    epsilon: float

    def __post_init__(self) -> None:
        if not (self.max_value > 0 and self.first > 0 and self.ratio > 1 and self.epsilon > 0):
            raise ValueError(f"bad histogram options {self!r}: max_value, first, epsilon > 0 and ratio > 1")

    @property
    def num_buckets(self) -> int:
        return math.ceil(math.log(self.max_value * (self.ratio - 1) / self.first + 1, self.ratio)) + 1

    def bucket(self, value: float) -> int:
        if value < self.first:
            return 0
        index = int(math.log(value * (self.ratio - 1) / self.first + 1, self.ratio))
        return min(index, self.num_buckets - 1)

    def bucket_start(self, index: int) -> float:
        if index == 0:
            return 0.0
        return self.first * (self.ratio**index - 1) / (self.ratio - 1)


class DecayingHistogram:
    """Weights per bucket (sparse), with exponential decay by ``half_life`` seconds."""

    __slots__ = ("half_life", "options", "reference", "total", "weights")

    def __init__(self, options: BucketOptions, half_life: float, reference: float = 0.0) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0 (got {half_life!r})")
        self.options = options
        self.half_life = half_life
        self.reference = reference
        self.weights: dict[int, float] = {}
        self.total = 0.0

    def add(self, value: float, weight: float, ts: float) -> None:
        """One sample at Unix time ``ts`` (weights below ``epsilon`` are raised to it)."""
        if not math.isfinite(value) or value < 0:
            return
        if not self.weights:
            self.reference = ts  # an empty histogram starts its clock at its first sample
        exponent = (ts - self.reference) / self.half_life
        if exponent > _MAX_DECAY_EXPONENT:
            self._shift(ts)
            exponent = 0.0
        scaled = max(weight, self.options.epsilon) * 2.0**exponent
        index = self.options.bucket(value)
        self.weights[index] = self.weights.get(index, 0.0) + scaled
        self.total += scaled

    def _shift(self, ts: float) -> None:
        factor = 2.0 ** (-(ts - self.reference) / self.half_life)
        self.weights = {i: w * factor for i, w in self.weights.items() if w * factor > 0}
        self.total = sum(self.weights.values())
        self.reference = ts

    def empty(self) -> bool:
        return self.total < self.options.epsilon

    def percentile(self, p: float) -> float:
        if self.empty():
            return 0.0
        threshold = p * self.total
        partial = 0.0
        last = self.options.num_buckets - 1
        chosen = max(self.weights)
        for index in sorted(self.weights):
            partial += self.weights[index]
            if partial >= threshold:
                chosen = index
                break
        return self.options.bucket_start(chosen + 1 if chosen < last else chosen)

    # --- checkpoints ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "weights": [[i, w] for i, w in sorted(self.weights.items())]}

    @classmethod
    def from_dict(cls, raw: object, options: BucketOptions, half_life: float) -> DecayingHistogram:
        """From ``to_dict``'s output; ValueError naming what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError(f"histogram: not a mapping (got {type(raw).__name__})")
        reference, pairs = raw.get("reference"), raw.get("weights")
        if isinstance(reference, bool) or not isinstance(reference, int | float) or not isinstance(pairs, list):
            raise ValueError("histogram: needs a numeric reference and a list of weights")
        out = cls(options, half_life, float(reference))
        for pair in pairs:
            if (not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], int)
                    or not isinstance(pair[1], int | float)):
                raise ValueError(f"histogram: bad bucket {pair!r}")
            index, weight = pair[0], float(pair[1])
            if not 0 <= index < options.num_buckets or not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"histogram: bucket {index} weight {weight!r} out of range")
            out.weights[index] = weight
            out.total += weight
        return out
