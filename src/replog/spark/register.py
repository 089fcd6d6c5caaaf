"""Explicit registration of both formats, for sessions where auto-registration cannot work.

Spark 4.3 auto-registers the formats when the wheel is installed in the Python that runs
Spark (modules ``pyspark_replog`` and ``pyspark_replog_sink``). With
``spark-submit --py-files replog.whl`` the package is not importable in Spark's
streaming runner processes, so :func:`register` pickles replog's modules *by value*
into the registered classes: the workers then need nothing but pyarrow, fsspec and numpy.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import sys
from typing import TYPE_CHECKING

from replog.about import PACKAGE, PACKAGE_DIR

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)


def _installed_in_site_packages() -> bool:
    return "site-packages" in PACKAGE_DIR or "dist-packages" in PACKAGE_DIR


def register(spark: SparkSession, *, by_value: bool | None = None) -> None:
    """Register ``replog`` and ``replog-sink`` with ``spark``.

    ``by_value`` (default: when replog is not installed in site-packages, e.g. shipped
    with ``--py-files`` or run from a checkout) makes the registered classes carry
    replog's code instead of a reference to an importable module.
    """
    from pyspark import cloudpickle  # noqa: PLC0415

    from replog.spark.sink import ReplogSinkDataSource  # noqa: PLC0415
    from replog.spark.source import ReplogDataSource  # noqa: PLC0415

    if by_value is None:
        by_value = not _installed_in_site_packages()
    if by_value:
        for module_info in pkgutil.walk_packages([PACKAGE_DIR], prefix=f"{PACKAGE}."):
            module = importlib.import_module(module_info.name)
            cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
        package = sys.modules[PACKAGE]  # imported already: this module is inside it
        cloudpickle.register_pickle_by_value(package)  # type: ignore[no-untyped-call]
    spark.dataSource.register(ReplogDataSource)
    spark.dataSource.register(ReplogSinkDataSource)
    logger.info("registered formats replog and replog-sink (by value: %s)", by_value)
