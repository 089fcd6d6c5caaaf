"""The ``replog`` command (console script ``replog = replog.cli:main``).

Errors end the command with exit status 2 and one line on stderr naming what is at
fault; ``--verbose`` adds the traceback. Commands that find problems (``verify``,
``manifest validate``, a blocked ``truncate --dry-run``) exit with 1.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Sequence

from replog.cli.output import JsonOutput, TextOutput
from replog.cli.parser import build_parser
from replog.errors import ReplogError
from replog.storage import redact

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``replog`` with ``argv`` (default: the process's arguments); the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    out = JsonOutput() if getattr(args, "json", False) else TextOutput()
    try:
        return int(args.handler(args, out))
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("replog: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        kind = (
            "" if isinstance(exc, ReplogError | OSError | ValueError) else f"{type(exc).__name__}: "
        )
        message = " ".join(f"{kind}{exc}".split()) or type(exc).__name__
        for secret in _secret_values(args):
            message = message.replace(secret, "***")
        print(f"replog: error: {message}", file=sys.stderr)
        return 2


def _secret_values(args: object) -> list[str]:
    """Values of secret ``--fs-option``s, which an error message must never show."""
    pairs = [pair.partition("=") for pair in getattr(args, "fs_option", [])]
    shown = redact({name: value for name, _, value in pairs})
    return [value for name, _, value in pairs if shown.get(name) == "***" and value]
