"""Exactly once and fencing for writers that name themselves (sinks, transactions): the
rules of FORMAT.md, "Sink marks", applied to a log's state.

* **Exactly once**: a log never takes a second commit of ``(sink id, query id, epoch)``
  (:func:`holds` says it has one, or a later epoch of that query).
* **Fencing**: a writer run carries a generation; a run new to a sink takes it over with
  the next generation, and an older run is refused before it writes anything
  (:func:`claim`). A run the sink mark no longer lists is still fenced by the generation
  it remembers committing with.
"""

from __future__ import annotations

import dataclasses

from replog.errors import FencedError, TransactionOrderError
from replog.format.commits import WriterInfo
from replog.format.state import LogState


def holds(state: LogState, writer: WriterInfo) -> bool:
    """Whether ``state`` already holds ``writer``'s epoch (or a later one of its query)."""
    mark = state.sinks.get(writer.sink_id)
    epoch = mark.epoch_of(writer.query_id) if mark else None
    return epoch is not None and epoch >= writer.epoch


def check_follows(state: LogState, writer: WriterInfo, follows: int) -> None:
    """Raise :class:`TransactionOrderError` unless ``state`` holds epoch ``follows`` of
    ``writer``'s query (0: none): another writer of the same sink committed meanwhile."""
    mark = state.sinks.get(writer.sink_id)
    epoch = (mark.epoch_of(writer.query_id) if mark else None) or 0
    if epoch != follows:
        raise TransactionOrderError(
            f"{writer.sink_id!r}: version {writer.epoch} was to follow version {follows}, but "
            f"the log holds version {epoch} (at log version {state.version}): another writer "
            f"of {writer.sink_id!r} committed meanwhile; nothing was committed"
        )


def claim(state: LogState, writer: WriterInfo) -> WriterInfo:
    """``writer`` with the generation its run commits with; raises :class:`FencedError`
    if a newer run owns the sink. A run new to the sink takes it over (generation + 1).
    A run the mark no longer lists (it keeps the newest runs) is still fenced if it says
    which generation it committed with before (``writer.generation``). Writers without a
    run id (batch writes) are not fenced."""
    mark = state.sinks.get(writer.sink_id)
    if writer.run_id is None:
        return writer
    if mark is None:
        return dataclasses.replace(writer, generation=1)
    known = mark.generation_of(writer.run_id)
    if known is None and writer.generation == 0:
        return dataclasses.replace(writer, generation=mark.generation + 1)
    if known is None:
        known = writer.generation
    if known < mark.generation:
        raise FencedError(
            f"sink {writer.sink_id!r}: run {writer.run_id} of query {writer.query_id} is "
            f"fenced: run {mark.owner} (query {mark.query_id}) took the sink over with "
            f"generation {mark.generation}; two live queries must not share a sinkId"
        )
    return dataclasses.replace(writer, generation=known)
