"""Hypothesis strategies shared by the property tests of untrusted-input parsers."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def scalars(*, int_bits: int = 66, finite: bool = False, text_size: int = 16) -> st.SearchStrategy[Any]:
    """JSON-ish leaves: null, booleans, big integers, floats (NaN and infinities unless
    ``finite``: a JSON decoder never yields them, YAML and Python callers can), text."""
    bound = 2**int_bits
    return st.one_of(
        st.none(), st.booleans(), st.integers(min_value=-bound, max_value=bound),
        st.floats(allow_nan=not finite, allow_infinity=not finite), st.text(max_size=text_size),
    )


def json_values(
    leaves: st.SearchStrategy[Any] | None = None, *, width: int = 3, key_size: int = 8, max_leaves: int = 12,
) -> st.SearchStrategy[Any]:
    """Nested lists and objects of ``leaves`` (``scalars()`` by default)."""
    return st.recursive(
        scalars() if leaves is None else leaves,
        lambda children: st.lists(children, max_size=width)
        | st.dictionaries(st.text(max_size=key_size), children, max_size=width),
        max_leaves=max_leaves,
    )
