"""``tasks.metrics.tiers``: the store's tiers, parsed here next to the store that checks them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from metrics.store.tsdb import (
    DEFAULT_COARSE_AFTER,
    DEFAULT_COARSE_STEP,
    DEFAULT_RAW_RETENTION,
    DEFAULT_ROLLUP_STEP,
    tier_problem,
)
from runtimeproxy.config.configvalues import Section, parse_duration


@dataclass(frozen=True, slots=True)
class StoreTiers:
    """The store's tiers (``metrics.store.tsdbrollup``): raw samples for ``raw``, then means
    per ``step``, per ``coarse_step`` once older than ``coarse_after``; all until the
    retention. Shorter ``raw`` or longer steps: a smaller file, coarser percentiles."""

    raw: float = DEFAULT_RAW_RETENTION
    step: float = DEFAULT_ROLLUP_STEP
    coarse_step: float = DEFAULT_COARSE_STEP
    coarse_after: float = DEFAULT_COARSE_AFTER


#: ``tier_problem``'s setting names -> the keys under ``tiers``.
_TIER_KEYS: Final = {"raw_retention": "raw", "rollup_step": "step", "coarse_step": "coarse_step"}


def parse_tiers(raw: object, key_path: str) -> StoreTiers:
    """The store's own rule (``tier_problem``) refuses bad tiers here, naming the key under
    ``key_path`` (the default's value when the key was not set)."""
    args = Section.of(raw, key_path)
    base = StoreTiers()
    args.reject_unknown(frozenset(StoreTiers.__slots__))
    tiers = StoreTiers(**{k: args.get(k, getattr(base, k), parse_duration) for k in StoreTiers.__slots__})
    problem = tier_problem(tiers.raw, tiers.step, tiers.coarse_step)
    if problem is not None:
        key = _TIER_KEYS[problem[0]]
        value = args.raw.get(key, f"{getattr(tiers, key):g}s (the default)")
        raise args.fail(key, value, problem[1].replace("rollup_step", "step"))
    return tiers
