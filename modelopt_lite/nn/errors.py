"""The errors whose types follow the reference library's: a feature it has that this library deliberately
leaves out, and a value it refuses with an ``assert``."""

from __future__ import annotations

__all__ = ["InvalidValueError", "UnsupportedFeatureError", "unsupported_class"]


class UnsupportedFeatureError(NotImplementedError, ValueError):
    """A reference feature this library does not implement; the message names it and what to use instead.

    It is a ``NotImplementedError`` (what it is) and a ``ValueError`` (what a bad attribute or option value
    raises, so existing ``except ValueError`` handlers and pydantic validation still catch it)."""


class InvalidValueError(ValueError, AssertionError):
    """A bad value that the reference refuses with an ``assert`` (an ``AssertionError``): a ``ValueError``
    here, as every bad value is, and an ``AssertionError`` so that its users' handlers still catch it."""


def unsupported_class(name: str, instead: str, module: str) -> type:
    """A class named ``name`` (in ``module``) whose construction raises :class:`UnsupportedFeatureError`
    saying ``instead``: the reference's name exists, and using it says what to do."""

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        raise UnsupportedFeatureError(f"{module}.{name} is not supported: {instead}")

    return type(
        name, (), {"__init__": __init__, "__doc__": f"Not supported: {instead}.", "__module__": module}
    )
