"""MySQL and MariaDB capture (``replog capture mysql``): the binlog into a log, with the
guarantees of the PostgreSQL capture (docs/CDC.md, "Capturing MySQL and MariaDB").

Modules: :mod:`.dsn` (the DSN and the options), :mod:`.columns` (types: schemas and exact
values), :mod:`.server` (connections, the catalog, checks, positions), :mod:`.binlog`
(reading whole transactions), :mod:`.positions` (the source position as a version),
:mod:`.events` (Debezium MySQL's events), :mod:`.ddl` (the statements the binlog carries),
:mod:`.chunks` (snapshot chunks between watermark rows) and :mod:`.capture` (the loop that
commits). This package never imports pyspark.
"""
