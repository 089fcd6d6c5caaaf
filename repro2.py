import os, sys, tempfile
from pyspark.sql.connect.session import SparkSession as RemoteSparkSession
os.environ["SPARK_CONNECT_MODE_ENABLED"]="1"
spark = RemoteSparkSession.builder.remote(f"sc://127.0.0.1:{sys.argv[1]}").getOrCreate()
import replog
from replog.log import ReplicationLog
d = tempfile.mkdtemp()
log = ReplicationLog.create(d + "/log", 2)
log.append([{"key": f"k{i}", "data": {"id": i}} for i in range(5)])
print(spark.read.format("replog").load(log.url).count())
from replog.spark.source import ReplogDataSource
spark.dataSource.register(ReplogDataSource)
replog.register(spark)
for i, (fmt, opts) in enumerate([("memory", {}), ("replog-sink", {}), ("memory", {"consumer": "c9"})]):
    reader = spark.readStream.format("replog")
    for k, v in opts.items(): reader = reader.option(k, v)
    w = reader.load(log.url).writeStream.format(fmt).trigger(availableNow=True).option("checkpointLocation", f"{d}/chk{i}")
    if fmt == "memory": w = w.queryName(f"m{i}")
    try:
        q = w.start() if fmt == "memory" else w.start(f"{d}/out{i}")
        q.awaitTermination()
        print("STREAM OK", i, fmt)
    except Exception as e:
        print("STREAM FAIL", i, fmt, str(e)[:600])
