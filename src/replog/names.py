"""Names of consumers and sinks: they become directory names in the log, so they are
kept to a safe alphabet everywhere they enter (options, the CLI, the core)."""

from __future__ import annotations

import re

from replog.errors import InvalidOptionError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def is_valid_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_name(name: str, option: str) -> str:
    """``name`` if it is a valid consumer or sink name, else :class:`InvalidOptionError`."""
    if not is_valid_name(name):
        raise InvalidOptionError(
            f"option {option!r}: {name!r} is not a valid name (letters, digits, '.', '_', '-'; "
            f"at most 128 characters, starting with a letter or digit)"
        )
    return name
