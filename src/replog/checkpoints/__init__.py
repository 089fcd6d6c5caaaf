"""Checkpoints: the durable positions of a log's consumers and the commit state of its sinks.

Both are checkpoint manifests (:mod:`.manifest`) in manifest stores (:mod:`.store`) kept
inside the log, under ``_replog/consumers/`` (:mod:`.consumers`) and ``_replog/sinks/``
(:mod:`.sinks`, with the sink's exactly-once commit protocol).
"""
