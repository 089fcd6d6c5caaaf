"""Which part of replog imports which: the package layering, computed from the source.

    .venv/bin/python tools/layers.py            # a Markdown table
    .venv/bin/python tools/layers.py --check    # exit 1 if a rule below is broken

A *part* is a subpackage of ``replog`` (``format``, ``storage``, ...) or a top-level
module (``log``, ``merges``, ...). Imports inside functions and under ``TYPE_CHECKING``
count too: a layering that only holds at import time is not one.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src" / "replog"

LAYERS = [
    ["errors", "timeutil", "names", "crashpoints", "about", "processlocal"],
    ["storage"],
    ["format"],
    ["core"],
    ["merges", "reading"],
    ["committing"],
    ["writing"],
    ["maintenance"],
    ["log", "appender"],
    ["checkpoints", "offsets"],
    ["schemas"],
    ["planning", "ops", "ingest", "debezium", "tables", "capture"],
    ["cli", "spark"],
    ["__init__"],
]
"""From the bottom: a part may import parts of its own layer or below, never above. A log
object's rooms each have a floor of their own, so their arrows run one way: reading <-
committing <- writing <- maintenance <- log (the face). The package's ``__init__`` is the
top: it imports the rest, and nothing imports it (``about`` says what the package is)."""


def part_of(module: str) -> str | None:
    """``replog.format.events`` -> ``format``; ``replog.log`` -> ``log``."""
    pieces = module.split(".")
    if pieces[0] != "replog":
        return None
    return pieces[1] if len(pieces) > 1 else "__init__"


def imports() -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(SOURCE.rglob("*.py")):
        relative = path.relative_to(SOURCE.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        own = part_of(module)
        assert own is not None
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
                if node.module == "replog":  # from replog import merges (or a name of __init__)
                    names = [
                        f"replog.{alias.name}"
                        if (SOURCE / alias.name).is_dir() or (SOURCE / f"{alias.name}.py").exists()
                        else "replog"
                        for alias in node.names
                    ]
            for name in names:
                if name.split(".")[0] == "pyspark":
                    found[own].add("pyspark")
                target = part_of(name)
                if target is not None and target != own:
                    found[own].add(target)
        found.setdefault(own, set())
    return found


def layer(part: str) -> int:
    for index, members in enumerate(LAYERS):
        if part in members:
            return index
    raise SystemExit(f"part {part!r} is in no layer: add it to LAYERS")


def problems(found: dict[str, set[str]]) -> list[str]:
    wrong = []
    for part, targets in sorted(found.items()):
        for target in sorted(targets):
            if target == "pyspark":
                if part not in ("spark", "__init__"):  # __init__: a type hint of register()
                    wrong.append(f"{part} imports pyspark (only spark/ may)")
            elif layer(target) > layer(part):
                wrong.append(f"{part} (layer {layer(part)}) imports {target} (layer {layer(target)})")
    return wrong


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    found = imports()
    wrong = problems(found)
    if args.check:
        for line in wrong:
            print(line)
        return 1 if wrong else 0
    print("| layer | part | imports |\n|---|---|---|")
    for part in sorted(found, key=lambda p: (layer(p), p)):
        print(f"| {layer(part)} | `{part}` | {', '.join(sorted(found[part])) or '-'} |")
    if wrong:
        print("\nBroken rules:\n" + "\n".join(f"- {line}" for line in wrong))
    return 0


if __name__ == "__main__":
    sys.exit(main())
