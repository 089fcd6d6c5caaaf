"""Appends ``commits`` commits of ``per_commit`` events to a log (a racing-writer process).

Usage: append_worker.py URL WRITER_NAME COMMITS PER_COMMIT [STORAGE_OPTIONS_JSON]
Event ids are ``<writer>-<n>``, keys ``<writer>-k<n % 7>``, so a test can check every
event arrived once and per-key order held.
"""

import json
import sys

from replog.log import ReplicationLog

url, writer, commits, per_commit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
log = ReplicationLog.open(url, storage_options=options)
counter = 0
for _ in range(commits):
    events = []
    for _ in range(per_commit):
        events.append(
            {
                "event_id": f"{writer}-{counter}",
                "key": f"{writer}-k{counter % 7}",
                "data": {"n": counter},
                "collection": writer,
            }
        )
        counter += 1
    log.append(events)
