"""Names in the log: consumers and sinks become directory names, so they are kept to a
safe alphabet everywhere they enter (options, the CLI, the core); versioned files
(commits, snapshot headers, manifests) are ``<digits>.json``."""

from __future__ import annotations

import re
from collections.abc import Iterable

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


_VERSIONED_NAME = re.compile(r"([0-9]+)\.json")


def listed_versions(names: Iterable[str]) -> list[int]:
    """The versions of the ``<digits>.json`` names in a listing of commits, snapshot
    headers or checkpoint manifests, ascending. Anything else (a writer's temporary
    file, a stray, ``².json``) is not one."""
    matches = (_VERSIONED_NAME.fullmatch(name) for name in names)
    return sorted(int(match[1]) for match in matches if match)
