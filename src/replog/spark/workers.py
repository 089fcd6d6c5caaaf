"""What replog does for the Python processes Spark starts for it.

Spark's daemon runs ``gc.collect()`` in a Python worker after every request it serves (a
task on an executor, a micro-batch's planning or commit on the driver; ``daemon.py``).
A full collection walks every object the process tracks, and importing replog (with
fsspec, and pandas, which pyarrow imports on its first ``pa.array``/``pa.scalar``) takes
a worker from ~33,000 tracked objects to ~83,000: each collection went from ~7 ms to
25-40 ms, paid per task and per micro-batch in two driver-side processes (~0.5 s of CPU
per million events written by ``replog-sink`` in 4 micro-batches, measured).

:func:`settle` freezes what the process holds once its first request is served (its
modules, classes and caches, which live as long as the process): later collections walk
only what is created afterwards. Frozen objects are still freed when their reference
counts drop; only cyclic garbage among them would stay, and a collection runs first, so
only objects alive at that moment are frozen.
"""

from __future__ import annotations

import gc
import logging
import sys

logger = logging.getLogger(__name__)

_settled = False


def in_spark_worker() -> bool:
    """Whether this process is one Spark started to run Python (``python -m pyspark.…``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and str(spec.name).startswith("pyspark.")


def settle() -> None:
    """Once per Spark Python worker: collect, then freeze the objects that remain."""
    global _settled  # noqa: PLW0603 (one flag per process)
    if _settled or not in_spark_worker():
        return
    _settled = True
    gc.collect()
    gc.freeze()
    logger.debug("froze %d objects of this Spark Python worker", gc.get_freeze_count())
