"""Operating a log: status, verification, retention, compaction, garbage and recovery.

What the ``replog`` operator commands do, as functions that return typed results.
"""
