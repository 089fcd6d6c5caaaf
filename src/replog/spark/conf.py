"""A Spark session setting changed for one call, then put back as it was."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pyspark.sql import SparkSession


@contextmanager
def setting(session: SparkSession, key: str, value: Callable[[str | None], str]) -> Iterator[None]:
    """Set ``key`` to ``value(current)`` (current: None when unset) for the ``with``
    block; afterwards the session holds what it held before, or nothing."""
    given = session.conf.get(key, None)
    session.conf.set(key, value(given))
    try:
        yield
    finally:
        if given is None:
            session.conf.unset(key)
        else:
            session.conf.set(key, given)
