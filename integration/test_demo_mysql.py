"""``make demo-mysql``'s pipeline end to end (examples/demo_mysql.py, small sizes): MariaDB
-> capture mysql (snapshot, then following an order workload with an ALTER half-way) ->
Spark -> apply_changes -> Delta, which must equal the MariaDB table row by row."""

from __future__ import annotations

from pathlib import Path

import demo_mysql
import pytest
from support.mariadb import USER
from support.mysql import Db


@pytest.mark.slow
@pytest.mark.spark
def test_delta_table_equals_the_mariadb_table(mysql_db: Db, spark, tmp_path: Path) -> None:
    mysql_db.server.sql(f"GRANT ALL ON `{mysql_db.name}`.* TO '{USER}'@'%'")  # the workload's
    result = demo_mysql.pipeline(mysql_db.dsn, tmp_path / "demo", orders=60, transactions=80,
                                 spark=spark)  # fmt: skip
    assert result.rows > 60
    assert (result.missing, result.extra, result.changed) == ([], [], [])
    assert result.equal
