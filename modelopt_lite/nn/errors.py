"""The error raised by a feature of the reference library that this library deliberately leaves out."""

from __future__ import annotations

__all__ = ["UnsupportedFeatureError"]


class UnsupportedFeatureError(NotImplementedError, ValueError):
    """A reference feature this library does not implement; the message names it and what to use instead.

    It is a ``NotImplementedError`` (what it is) and a ``ValueError`` (what a bad attribute or option value
    raises, so existing ``except ValueError`` handlers and pydantic validation still catch it)."""
