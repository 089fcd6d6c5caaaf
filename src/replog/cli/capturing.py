"""What ``replog capture postgres`` and ``replog capture mysql`` share: the capture's log
(created only once the source passed its checks), ``--keys``, and the run itself: stopped
cleanly by Ctrl-C or SIGTERM (after the commit in progress, saying so at once; a second
Ctrl-C stops at once), its progress on stderr and, with ``--metrics-port``, Prometheus
metrics."""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pyarrow as pa

from replog.capture.progress import CaptureProgress
from replog.cli.metrics import CaptureMetrics, serve
from replog.cli.output import Output
from replog.cli.progress import CaptureDisplay, display_for
from replog.errors import InvalidOptionError, LogNotFoundError
from replog.format.commits import DEFAULT_SHARDS
from replog.format.limits import check_shards
from replog.log import ReplicationLog

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

Progress = Callable[[CaptureProgress], None]
Ran = TypeVar("Ran")


def common_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options both captures take, from the command line."""
    return {
        "dsn": args.dsn,
        "tables": tuple(t.strip() for t in (args.tables or "").split(",") if t.strip()),
        "snapshot": args.snapshot,
        "follow": args.follow,
        "max_changes": args.max_changes,
        "snapshot_chunk_rows": args.snapshot_chunk_rows,
        "stage_events": args.stage_events,
        "skip_truncate": args.skip_truncate,
        "tables_changed": args.tables_changed,
    }


def parse_keys(
    pairs: Sequence[str], qualified: Callable[[str], str], form: str
) -> dict[str, tuple[str, ...]]:
    """``--keys table=col[,col...]`` (each table named as ``qualified`` names it; ``form``
    says how the option is written, in errors)."""
    keys: dict[str, tuple[str, ...]] = {}
    for pair in pairs:
        table, sep, columns = pair.partition("=")
        names = tuple(c.strip() for c in columns.split(",") if c.strip())
        if not sep or not table or not names:
            raise InvalidOptionError(f"--keys expects {form}=col[,col...], got {pair!r}")
        keys[qualified(table)] = names
    return keys


def capture_log(
    args: argparse.Namespace, fs_options: dict[str, Any], check_source: Callable[[], None]
) -> ReplicationLog:
    """The capture's log. One that exists must have the ``--shards`` asked for, if any; a
    missing one is created only once the source has passed its checks (``check_source``:
    an unreachable server or a missing table must leave nothing behind, nor a log whose
    shard count a later, corrected command could no longer choose)."""
    if args.shards is not None:
        check_shards(args.shards, "--shards")
    try:
        log = ReplicationLog.open(args.url, storage_options=fs_options)
    except LogNotFoundError:
        pass
    else:
        if args.shards is not None and args.shards != log.shards:
            raise InvalidOptionError(
                f"--shards {args.shards}: the log at {args.url} exists with {log.shards} "
                f"shards (a log's shard count is fixed; --shards applies when capture "
                f"creates the log)"
            )
        return log
    check_source()
    shards = DEFAULT_SHARDS if args.shards is None else args.shards
    return ReplicationLog.open_or_create(args.url, shards, storage_options=fs_options)


def serve_metrics(metrics: CaptureMetrics, port: int | None) -> tuple[Any, int | None]:
    """The ``--metrics-port`` endpoint (None without one) and the port it bound (0 asks
    for any free one), said at once on stderr (also under --json, whose stdout holds only
    the summary): a script learns where to scrape as soon as the endpoint is up."""
    if port is None:
        return None, None
    server = serve(metrics, port)
    bound = int(server[0].server_port)
    print(f"replog: metrics at http://{socket.gethostname()}:{bound}/metrics",
          file=sys.stderr, flush=True)  # fmt: skip
    return server, bound


def run_capture(
    out: Output,
    metrics: CaptureMetrics,
    metrics_port: int | None,
    work: Callable[[threading.Event, Progress], Ran],
    *,
    log_name: str = "WAL",
) -> tuple[Ran, int | None]:
    """Run ``work(stop, progress)`` (opening the capture and running it) with its progress
    shown and served as metrics, and Ctrl-C / SIGTERM setting ``stop``; what it returned
    and the metrics port bound (None: no ``--metrics-port``)."""
    # A capture runs for days in a process of its own: the system allocator gives memory
    # freed by a merge or a staged piece back, where Arrow's jemalloc keeps it for reuse
    # (measured at 10M rows: 345 MB against 568 MB peak RSS, at the same speed).
    pa.set_memory_pool(pa.system_memory_pool())
    stop = threading.Event()
    server, port = serve_metrics(metrics, metrics_port)
    try:
        with display_for(out.json) as display:
            shown = CaptureDisplay(display, log_name)
            saying: list[threading.Thread] = []

            def progress(state: CaptureProgress) -> None:
                metrics.update(state)
                shown(state)

            def stop_now() -> None:
                stop.set()
                shown.stopping()

            def stopping(signum: int, frame: object) -> None:
                if not saying:
                    # set from a thread: the handler runs in the main thread, which may
                    # be inside stop.wait() holding the event's lock (set() here then
                    # waited on it for ever: a followed capture's SIGTERM hung it), or
                    # drawing the display
                    saying.append(threading.Thread(target=stop_now, daemon=True))
                    saying[-1].start()
                    signal.signal(signal.SIGINT, signal.default_int_handler)  # again: now

            previous = {sig: signal.signal(sig, stopping) for sig in STOP_SIGNALS}
            try:
                ran = work(stop, progress)
            except Exception:
                metrics.failed()
                raise
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                for thread in saying:
                    thread.join()
                shown.close()
    finally:
        if server is not None:
            server[0].shutdown()
            server[0].server_close()
    return ran, port
