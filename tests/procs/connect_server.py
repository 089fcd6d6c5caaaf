"""A local Spark Connect server for the ``connect`` test tier, in a process of its own.

Usage: connect_server.py MASTER. Starts a regular Spark session with Spark Connect's plugin
on an ephemeral loopback port, prints ``READY <port>`` and serves until its stdin closes.
A process of its own because a Python process holds one Spark context: the ``spark``
fixture's classic session and the Connect server's cannot share one.
"""

import sys

from pyspark.sql import SparkSession

master = sys.argv[1] if len(sys.argv) > 1 else "local[2]"
spark = (
    SparkSession.builder.master(master)
    .appName("replog-connect-tests")
    .config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
    .config("spark.connect.grpc.binding.address", "127.0.0.1")
    .config("spark.connect.grpc.binding.port", "0")
    .config("spark.ui.enabled", "false")
    .config("spark.sql.shuffle.partitions", "2")
    .config("spark.sql.streaming.pollingDelay", "50ms")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")
jvm = spark.sparkContext._jvm
service = jvm.java.lang.Class.forName("org.apache.spark.sql.connect.service.SparkConnectService$")
port = service.getField("MODULE$").get(None).localPort()
print(f"READY {port}", flush=True)
sys.stdin.read()  # until the test run closes our stdin
spark.stop()
