"""What a strategy derives from the pod list alone, kept while the list is the same object.

The manager hands the same tuple every round while no pod changes (``QoSManager._plan``;
the pod list is a new tuple whenever a pod does) and ``PodView`` is frozen, so anything
computed from the tuple alone (parsed cgroup paths, the tiers above them) holds until
another tuple comes (issue 29: ~110 ``PurePosixPath`` parses and walks a round for
nothing). Keyed on the tuple's identity, which the memo keeps alive: a new list cannot
take its address. Anything but a tuple is derived afresh on each call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from metrics.model import PodView

__all__ = ["PodListMemo"]

T = TypeVar("T")


class PodListMemo(Generic[T]):
    """``build(pods)`` of the last pod tuple seen (one entry: the round's list)."""

    __slots__ = ("_build", "_last")

    def __init__(self, build: Callable[[Sequence[PodView]], T]) -> None:
        self._build = build
        self._last: tuple[tuple[PodView, ...], T] | None = None

    def __call__(self, pods: Sequence[PodView]) -> T:
        last = self._last
        if last is not None and last[0] is pods:
            return last[1]
        value = self._build(pods)
        if isinstance(pods, tuple):  # a list may change in place: never remembered
            self._last = (pods, value)
        return value
