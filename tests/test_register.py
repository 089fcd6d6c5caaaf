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
    finally:
        for module in [replog, *modules]:
            cloudpickle.unregister_pickle_by_value(module)
