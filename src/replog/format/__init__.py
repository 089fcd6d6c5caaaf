"""The storage format (docs/FORMAT.md): events, segments, commits, state and history.

Pure data and file layouts; nothing here knows about Spark, consumers or sinks.
"""
