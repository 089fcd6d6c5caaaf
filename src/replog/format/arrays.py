"""Arrow arrays built from Python values without ``pyarrow.array``.

``pa.array`` asks pyarrow's pandas shim whether its input is a pandas object, and the
shim imports pandas (when installed) to find out: ~130 ms and ~50,000 objects in every
Python process Spark starts for replog, each of which Spark's daemon then walks with
``gc.collect()`` after every task and micro-batch (25-40 ms a time, measured). Code that
runs in those processes builds its arrays here instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

_INT32_MAX = 2**31 - 1


def strings(values: Sequence[str]) -> pa.Array:
    """A ``string`` array of ``values`` (no nulls)."""
    encoded = [value.encode("utf-8") for value in values]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(item) for item in encoded], out=offsets[1:])
    data = pa.py_buffer(b"".join(encoded))
    if offsets[-1] > _INT32_MAX:
        large = pa.Array.from_buffers(
            pa.large_string(), len(encoded), [None, pa.py_buffer(offsets), data]
        )
        return large.cast(pa.string())  # too large for one array: Arrow says so
    narrow = offsets.astype(np.int32)
    return pa.Array.from_buffers(pa.string(), len(encoded), [None, pa.py_buffer(narrow), data])
