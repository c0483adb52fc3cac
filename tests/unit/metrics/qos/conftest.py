"""Shared fixtures for the QoS strategy tests.

* ``closing``: ``closing(env)`` hands ``env`` back and closes its ``store`` (the TSDB each
  test environment reads from) when the test ends, however many environments it made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

E = TypeVar("E")


@pytest.fixture
def closing() -> Iterator[Callable[[E], E]]:
    made: list[Any] = []

    def keep(env: E) -> E:
        made.append(env)
        return env

    yield keep
    for env in made:
        env.store.close()
