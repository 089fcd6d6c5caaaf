"""The ``replog`` command (console script ``replog = replog.cli:main``).

Errors end the command with exit status 2 and one line on stderr naming what is at
fault (``--json``: an error document on stdout, schema ``error``); ``--verbose`` adds the
traceback. Commands that find problems (``verify``, ``manifest validate``, a blocked
``truncate --dry-run``) exit with 1. Ctrl-C ends a command with 130 and says what it left
(``tail --follow`` and ``capture`` stop cleanly with 0).
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Sequence

from replog.cli.commands import INTERRUPTED
from replog.cli.output import JsonOutput, Output, TextOutput
from replog.cli.parser import UsageError, build_parser
from replog.errors import ReplogError
from replog.storage import redact

__all__ = ["main"]

USAGE_EXIT = 2
ERROR_EXIT = 2
INTERRUPTED_EXIT = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``replog`` with ``argv`` (default: the process's arguments); the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(arguments)
    except UsageError as exc:
        if "--json" in arguments:
            JsonOutput().error(str(exc), USAGE_EXIT, "UsageError")
        else:
            print(exc.usage + str(exc), file=sys.stderr)
        return USAGE_EXIT
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    wants_json = args.json or (args.command == "status" and args.format == "json")
    out: Output = (JsonOutput if wants_json else TextOutput)(verbose=args.verbose)
    try:
        return int(args.handler(args, out))
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        left = INTERRUPTED.get(args.command)
        message = "interrupted" + (f": {left}" if left else "")
        if out.json:
            out.error(message, INTERRUPTED_EXIT, "KeyboardInterrupt")
        else:
            print(f"replog: {message}", file=sys.stderr)
        return INTERRUPTED_EXIT
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        kind = (
            "" if isinstance(exc, ReplogError | OSError | ValueError) else f"{type(exc).__name__}: "
        )
        message = " ".join(f"{kind}{exc}".split()) or type(exc).__name__
        for secret in _secret_values(args):
            message = message.replace(secret, "***")
        out.error(message, ERROR_EXIT, type(exc).__name__)
        return ERROR_EXIT


def _secret_values(args: object) -> list[str]:
    """Values of secret ``--fs-option``s, which an error message must never show."""
    pairs = [pair.partition("=") for pair in getattr(args, "fs_option", [])]
    shown = redact({name: value for name, _, value in pairs})
    return [value for name, _, value in pairs if shown.get(name) == "***" and value]
