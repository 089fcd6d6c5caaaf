"""Counts the row changes a MySQL binlog holds, read by mysql-replication as it ships (its
own row decoding: replog, which replaces it, is not imported here): the independent count a
capture's log is checked against.

Usage: binlog_count.py HOST PORT USER PASSWORD FILE POS DATABASE
Prints one JSON object: {table: {"insert": n, "update": n, "key_change": n, "delete": n,
"truncate": n}} for the binlog from FILE:POS to its end (key changes: updates whose
``id`` changed, which a capture writes as a delete and a create).
"""

import json
import sys

from pymysqlreplication import BinLogStreamReader
from pymysqlreplication.event import QueryEvent
from pymysqlreplication.row_event import DeleteRowsEvent, UpdateRowsEvent, WriteRowsEvent

host, port, user, password, file, pos, database = sys.argv[1:8]
stream = BinLogStreamReader(
    connection_settings={"host": host, "port": int(port), "user": user, "passwd": password},
    server_id=987_654,
    blocking=False,
    log_file=file,
    log_pos=int(pos),
    resume_stream=True,
    only_schemas=[database],
    only_events=[WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent, QueryEvent],
)
counts: dict[str, dict[str, int]] = {}


def bump(table: str, what: str, n: int = 1) -> None:
    found = counts.setdefault(
        table, {"insert": 0, "update": 0, "key_change": 0, "delete": 0, "truncate": 0}
    )
    found[what] += n


for event in stream:
    if isinstance(event, QueryEvent):
        words = event.query.split()
        if words and words[0].upper() == "TRUNCATE":
            bump(words[-1].strip("`").split(".")[-1].strip("`"), "truncate")
        continue
    if isinstance(event, WriteRowsEvent):
        bump(event.table, "insert", len(event.rows))
    elif isinstance(event, DeleteRowsEvent):
        bump(event.table, "delete", len(event.rows))
    else:
        for row in event.rows:
            changed = row["before_values"]["id"] != row["after_values"]["id"]
            bump(event.table, "key_change" if changed else "update")
stream.close()
print(json.dumps(counts))
