"""CPU seconds used by this process's tree (Spark's JVM and every Python process it
started), read from /proc: on a shared machine a steadier figure than wall time."""

from __future__ import annotations

import os
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _under(root: int) -> list[tuple[int, list[str]]]:
    """The live processes under ``root``: (pid, its ``stat`` fields after the name)."""
    children: dict[int, list[tuple[int, list[str]]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(entry)
            if fields is not None:
                children.setdefault(int(fields[1]), []).append((int(entry), fields))
    found, stack = [], [root]
    while stack:
        for pid, fields in children.get(stack.pop(), []):
            found.append((pid, fields))
            stack.append(pid)
    return found


def descendants(root: int | None = None) -> dict[int, tuple[float, str]]:
    """The live processes under ``root`` (default: this process): pid -> (user + system
    CPU seconds, command line)."""
    if not Path("/proc").is_dir():
        return {}
    found: dict[int, tuple[float, str]] = {}
    for pid, fields in _under(root or os.getpid()):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        found[pid] = (sum(int(v) for v in fields[11:13]) / _TICKS, command.decode().strip())
    return found


def jvm_cpu_seconds(root: int | None = None) -> float:
    """User + system CPU of the Java processes under ``root`` (Spark's JVM)."""
    return sum(
        cpu for cpu, command in descendants(root).values() if command.split(" ")[0].endswith("java")
    )


def tree_cpu_seconds(root: int | None = None) -> float:
    """User + system CPU of ``root`` (default: this process) and its descendants, the
    ones that exited included (their parents' ``cutime``/``cstime``)."""
    if not Path("/proc").is_dir():
        return 0.0
    own = _stat(str(root or os.getpid()))
    total = sum(int(value) for value in own[11:15]) if own else 0
    total += sum(sum(int(v) for v in fields[11:15]) for _, fields in _under(root or os.getpid()))
    return total / _TICKS


def load_average() -> str:
    """The 1-minute load average and the cores, for the record."""
    if not hasattr(os, "getloadavg"):
        return "n/a"
    return f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
