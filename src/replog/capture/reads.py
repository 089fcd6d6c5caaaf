"""The SQL that reads rows of a captured table for its snapshot, on a session of its own.

DESIGN: a snapshot reads a table in key order (ranges of keys after the last one read)
or, when its key is no unique index of NOT NULL columns, in physical order (ranges of
blocks of one leaf relation at a time, leaves in the order of their ids). Each read names
its relation by id, so a table renamed while its snapshot runs is read on under its
collection, and a partition by identity, never by a position in a list that a DETACH
shifts. The capture process (:mod:`~replog.capture.chunks`) and its workers
(:mod:`~replog.capture.workers`) read through this one face.

Each value is read as its type's output function writes it (:func:`text_rows`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql

from replog.capture.source import PostgresSource, Table, copy_rows, relation_of, text_rows

logger = logging.getLogger(__name__)

Key = list[str | None]
"""A key as its columns' text, in key order."""


class RelationGone(Exception):  # noqa: N818 - a state the chunk reader acts on, never escapes
    """The relation a read names no longer exists (dropped meanwhile)."""


class TableRows:
    """Reads rows of captured tables on ``connection`` (the source's catalog says their
    key columns' types)."""

    def __init__(self, source: PostgresSource, connection: psycopg.Connection[Any]) -> None:
        self.source = source
        self.connection = connection

    def relation(self, oid: int) -> sql.Composable:
        """Relation ``oid`` as a read names it (:func:`~replog.capture.source.relation_of`).
        Raises :class:`RelationGone` for one dropped meanwhile."""
        found = relation_of(self.connection, oid)
        if found is None:
            raise RelationGone(oid)
        return found

    def _select(self, table: Table, relation: sql.Composable) -> sql.Composed:
        columns = sql.SQL(", ").join(sql.Identifier(name) for name, _, _ in table.columns)
        return sql.SQL("SELECT {} FROM {}").format(columns, relation)

    def _keys(self, table: Table) -> sql.Composed:
        return sql.SQL(", ").join(sql.Identifier(name) for name in table.key)

    def key_range(
        self,
        table: Table,
        relation: int,
        after: Key | None,
        upto: Key | None,
        limit: int | None = None,
    ) -> pa.Table:
        """Rows of relation ``relation`` (``table`` or one of its partitions) with keys
        after ``after`` (None: from the first) up to and including ``upto`` (None: no
        bound), in key order, at most ``limit``."""
        keys = self._keys(table)
        bound = self.source.key_bound(table)
        query = self._select(table, self.relation(relation))
        conditions: list[sql.Composable] = []
        params: list[Any] = []
        if after is not None:
            conditions.append(sql.SQL("({}) > ({})").format(keys, bound))
            params.extend(after)
        if upto is not None:
            conditions.append(sql.SQL("({}) <= ({})").format(keys, bound))
            params.extend(upto)
        if conditions:
            query = sql.SQL("{} WHERE {}").format(query, sql.SQL(" AND ").join(conditions))
        query = sql.SQL("{} ORDER BY {}").format(query, keys)
        if limit is not None:
            query = sql.SQL("{} LIMIT {}").format(query, sql.Literal(limit))
        return copy_rows(self.connection, query, params)

    def key_cuts(
        self, table: Table, relation: int, after: Key | None, every: int, count: int
    ) -> tuple[list[Key], Key | None]:
        """The keys that cut the next ``count`` x ``every`` rows after ``after`` into
        ranges of ``every`` rows (each range's last key), and the last key of the relation
        after ``after`` when fewer rows than that are left (None: more are left, or none).
        Rows inserted later with keys past that last key are the stream's."""
        keys = self._keys(table)
        bound = self.source.key_bound(table)
        relation_sql = self.relation(relation)
        inner = sql.SQL("SELECT {}, row_number() OVER (ORDER BY {}) AS n FROM {}").format(
            keys, keys, relation_sql
        )
        params: list[Any] = []
        if after is not None:
            inner = sql.SQL("{} WHERE ({}) > ({})").format(inner, keys, bound)
            params = list(after)
        inner = sql.SQL("{} ORDER BY {} LIMIT {}").format(inner, keys, sql.Literal(count * every))
        cuts = [
            list(row[:-1])
            for row in text_rows(
                self.connection,
                sql.SQL("SELECT * FROM ({}) s WHERE n %% {} = 0 ORDER BY n").format(
                    inner, sql.Literal(every)
                ),
                params,
            )
        ]
        if len(cuts) == count:
            return cuts, None
        last = text_rows(
            self.connection,
            sql.SQL("SELECT {} FROM {}{} ORDER BY {} LIMIT 1").format(
                keys,
                relation_sql,
                sql.SQL(" WHERE ({}) > ({})").format(keys, bound) if after else sql.SQL(""),
                sql.SQL(", ").join(sql.SQL("{} DESC").format(sql.Identifier(k)) for k in table.key),
            ),
            params,
        )
        return cuts, list(last[0]) if last else None

    def leaves(self, oid: int) -> list[int]:
        """The leaf relations of table ``oid`` in the order of their ids (the table itself
        when it is not partitioned)."""
        found = [
            int(leaf)
            for (leaf,) in self.connection.execute(
                "SELECT relid::oid FROM pg_partition_tree(%s) WHERE isleaf ORDER BY 1", (oid,)
            ).fetchall()
        ]
        return found or [oid]

    def blocks(
        self, table: Table, leaf: int, block: int, rows: int, filenode: int
    ) -> tuple[pa.Table, int, int]:
        """About ``rows`` rows of leaf relation ``leaf`` from block ``block`` on (every row
        of a range of whole blocks), the block after the range, and the storage
        (``relfilenode``) the blocks count in; no rows and the block past the relation's
        end when it has no more. ``filenode``: the storage ``block`` counted in (0: none
        yet). A relation rewritten since (``VACUUM FULL``, ``CLUSTER``, pg_repack: its rows
        moved to other blocks, and no change says so) is read again from its first block.
        The read holds the relation's lock from before it looks at its storage to its
        end, so no rewrite falls between."""
        relation = self.relation(leaf)
        with self.connection.transaction():
            try:
                self.connection.execute(sql.SQL("SELECT FROM {} LIMIT 0").format(relation))
            except psycopg.errors.UndefinedTable as exc:  # dropped since it was named
                raise RelationGone(leaf) from exc
            row = self.connection.execute(
                "SELECT pg_relation_size(%s) / current_setting('block_size')::int,"
                " CASE WHEN relpages > 0 THEN greatest(reltuples / relpages, 1) ELSE 100 END,"
                " pg_relation_filenode(%s) FROM pg_class WHERE oid = %s",
                (leaf, leaf, leaf),
            ).fetchone()
            if row is None:
                raise RelationGone(leaf)
            size, per_block, storage = row[0], row[1], int(row[2])
            if block and storage != filenode:
                logger.warning(
                    "%s was rewritten while its snapshot read it in physical order (VACUUM "
                    "FULL, CLUSTER?): it is read again from its first block",
                    table.qualified,
                )
                block = 0
            if block >= size:
                return no_rows(table), block, storage
            step = max(1, int(rows / per_block))
            query = sql.SQL("{} WHERE ctid >= %s::tid AND ctid < %s::tid").format(
                self._select(table, relation)
            )
            found = copy_rows(self.connection, query, (f"({block},0)", f"({block + step},0)"))
        return found, block + step, storage


def no_rows(table: Table) -> pa.Table:
    """No row of ``table``, as :meth:`TableRows.key_range` gives rows."""
    return pa.table({f"c{index}": pa.array([], pa.string()) for index in range(len(table.columns))})


def last_key(table: Table, rows: pa.Table) -> Key | None:
    """The key (each key column's text) of the last of ``rows`` (every column of
    ``table``, in order); None for no rows."""
    if rows.num_rows == 0:
        return None
    names = [name for name, _, _ in table.columns]
    return [rows.column(names.index(key))[rows.num_rows - 1].as_py() for key in table.key]


def next_leaf(leaves: Sequence[int], current: int) -> int | None:
    """The first leaf whose id follows ``current`` (0: none read yet), or None."""
    return next((leaf for leaf in leaves if leaf > current), None)
