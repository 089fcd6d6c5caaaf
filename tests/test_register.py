"""register(): replog's code must pickle by value (spark-submit --py-files recipe)."""

import importlib
import pkgutil

from pyspark import cloudpickle

import replog
from replog.spark.sink import ReplogSinkDataSource
from replog.spark.source import ReplogDataSource


def test_every_module_pickles_by_value() -> None:
    """What ``replog.register(spark, by_value=True)`` makes Spark do, without Spark: a
    module-level object that cannot be pickled (a C scanner, a lock) fails here."""
    modules = [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(replog.__path__, prefix="replog.")
    ]
    for module in [replog, *modules]:
        cloudpickle.register_pickle_by_value(module)
    try:
        for source in (ReplogDataSource, ReplogSinkDataSource):
            restored = cloudpickle.loads(cloudpickle.dumps(source))
            assert restored.name() == source.name()
        # a task's function that names a module pickles that module whole, its globals
        # with it: apply_changes's micro-batch job after a register() failed on the lock
        # of merge_on_read's open tables ("cannot pickle '_thread.lock' object")
        # (capture's modules run in no task: its packers are C structs)
        for module in modules:
            if not module.__name__.startswith("replog.capture"):
                cloudpickle.dumps(module)  # what the driver does; a worker loads it
    finally:
        for module in [replog, *modules]:
            cloudpickle.unregister_pickle_by_value(module)


def test_a_storage_of_another_class_copy_is_not_taken_for_a_url(tmp_path) -> None:
    """By-value pickling (``replog.register``) can put two copies of the Storage class in
    one Python process; a Storage of the other copy must still be used as a Storage, not
    opened as a URL (issue 23: every stream after a batch read and register failed with
    "cannot open URL Storage(...): argument of type 'method' is not iterable")."""
    import pytest

    from replog.checkpoints.store import ManifestStore
    from replog.errors import InvalidOptionError
    from replog.storage import Storage

    copy = type("Storage", (), dict(Storage.__dict__))  # what a second pickle rebuilds
    storage = copy(str(tmp_path / "consumer"))
    assert not isinstance(storage, Storage)
    store = ManifestStore(storage)
    assert store.storage is storage and store.list_ids() == []
    with pytest.raises(InvalidOptionError, match="a storage URL must be a string"):
        Storage(storage)  # type: ignore[arg-type]
