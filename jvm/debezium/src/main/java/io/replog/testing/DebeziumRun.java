package io.replog.testing;

import com.fasterxml.jackson.core.JsonEncoding;
import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonGenerator;
import io.debezium.embedded.Connect;
import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.RecordChangeEvent;
import io.debezium.engine.format.ChangeEventFormat;
import io.debezium.transforms.ExtractNewRecordState;
import java.io.BufferedOutputStream;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.io.Reader;
import java.io.UncheckedIOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import org.apache.kafka.connect.header.Header;
import org.apache.kafka.connect.json.JsonConverter;
import org.apache.kafka.connect.source.SourceRecord;
import org.apache.kafka.connect.storage.SimpleHeaderConverter;

/**
 * Debezium's embedded engine, writing each record it gives as one JSON line: what Kafka
 * Connect would put into Kafka, serialized by JsonConverter (Connect's default converter)
 * and SimpleHeaderConverter (its default header converter).
 *
 * <pre>java -cp .jars/debezium/* io.replog.testing.DebeziumRun CONNECTOR.properties OUT.jsonl [all|kafka]</pre>
 *
 * Each line: {@code topic}, {@code key} and {@code value} (JsonConverter with schemas, the
 * exact text; null for a tombstone's value), {@code headers} ([name, text] pairs),
 * {@code at_ms} (the wall clock when the engine handed the record over). With {@code all}
 * (the default) also {@code key_plain}/{@code value_plain} (schemas.enable=false) and
 * {@code flat} (the value after ExtractNewRecordState with add.fields op,table,lsn,
 * source.ts_ms and deletes rewritten to {@code __deleted}: null when the SMT drops it).
 * With {@code count} each record is serialized all the same (keys and values with
 * schemas, what a Connect worker pays before its producer sends) but only a line
 * {@code {"count":N,"at_ms":T}} per batch is written, and the whole line of a record
 * whose value holds {@code "snapshot":"last"}: a benchmark's 10M records would be ~23 GB.
 * The engine runs until its standard input closes (or SIGTERM), then stops, committing
 * its offsets; "READY" on standard output once the engine is running.
 */
public final class DebeziumRun {
    private DebeziumRun() {}

    private static JsonConverter converter(boolean schemas, boolean isKey) {
        JsonConverter converter = new JsonConverter();
        converter.configure(Map.of("schemas.enable", String.valueOf(schemas)), isKey);
        return converter;
    }

    private static String text(byte[] bytes) {
        return bytes == null ? null : new String(bytes, StandardCharsets.UTF_8);
    }

    public static void main(String[] args) throws Exception {
        Properties properties = new Properties();
        try (Reader reader = Files.newBufferedReader(Path.of(args[0]))) {
            properties.load(reader);
        }
        boolean all = args.length < 3 || args[2].equals("all");
        boolean countOnly = args.length >= 3 && args[2].equals("count");
        JsonConverter keys = converter(true, true);
        JsonConverter values = converter(true, false);
        JsonConverter plainKeys = converter(false, true);
        JsonConverter plainValues = converter(false, false);
        SimpleHeaderConverter headers = new SimpleHeaderConverter();
        headers.configure(Map.of());
        ExtractNewRecordState<SourceRecord> flatten = new ExtractNewRecordState<>();
        flatten.configure(Map.of(
                "add.fields", "op,table,lsn,source.ts_ms",
                "delete.tombstone.handling.mode", "rewrite"));

        OutputStream out = new BufferedOutputStream(new FileOutputStream(args[1]), 1 << 20);
        JsonGenerator json = new JsonFactory().createGenerator(out, JsonEncoding.UTF8);
        json.setRootValueSeparator(null);
        AtomicReference<Throwable> failure = new AtomicReference<>();
        CountDownLatch stopped = new CountDownLatch(1);

        DebeziumEngine<RecordChangeEvent<SourceRecord>> engine = DebeziumEngine.create(ChangeEventFormat.of(Connect.class))
                .using(properties)
                .notifying((List<RecordChangeEvent<SourceRecord>> batch,
                            DebeziumEngine.RecordCommitter<RecordChangeEvent<SourceRecord>> committer) -> {
                    long at = System.currentTimeMillis();
                    try {
                    if (countOnly) {
                        for (RecordChangeEvent<SourceRecord> event : batch) {
                            SourceRecord record = event.record();
                            String topic = record.topic();
                            keys.fromConnectData(topic, record.keySchema(), record.key());
                            String value = text(values.fromConnectData(topic, record.valueSchema(), record.value()));
                            if (value != null && value.contains("\"snapshot\":\"last\"")) {
                                json.writeStartObject();
                                json.writeStringField("topic", topic);
                                json.writeStringField("value", value);
                                json.writeNumberField("at_ms", at);
                                json.writeEndObject();
                                json.writeRaw('\n');
                            }
                            committer.markProcessed(event);
                        }
                        json.writeStartObject();
                        json.writeNumberField("count", batch.size());
                        json.writeNumberField("at_ms", at);
                        json.writeEndObject();
                        json.writeRaw('\n');
                        json.flush();
                        committer.markBatchFinished();
                        return;
                    }
                    for (RecordChangeEvent<SourceRecord> event : batch) {
                        SourceRecord record = event.record();
                        String topic = record.topic();
                        json.writeStartObject();
                        json.writeStringField("topic", topic);
                        json.writeStringField("key", text(keys.fromConnectData(topic, record.keySchema(), record.key())));
                        json.writeStringField("value", text(values.fromConnectData(topic, record.valueSchema(), record.value())));
                        json.writeArrayFieldStart("headers");
                        for (Header header : record.headers()) {
                            json.writeStartArray();
                            json.writeString(header.key());
                            json.writeString(text(headers.fromConnectHeader(topic, header.key(), header.schema(), header.value())));
                            json.writeEndArray();
                        }
                        json.writeEndArray();
                        json.writeNumberField("at_ms", at);
                        if (all) {
                            json.writeStringField("key_plain", text(plainKeys.fromConnectData(topic, record.keySchema(), record.key())));
                            json.writeStringField("value_plain", text(plainValues.fromConnectData(topic, record.valueSchema(), record.value())));
                            SourceRecord flat = record.value() == null ? null : flatten.apply(record);
                            json.writeStringField("flat", flat == null ? null : text(plainValues.fromConnectData(topic, flat.valueSchema(), flat.value())));
                        }
                        json.writeEndObject();
                        json.writeRaw('\n');
                        committer.markProcessed(event);
                    }
                    json.flush();
                    } catch (IOException exc) {
                        throw new UncheckedIOException(exc);  // the engine stops, failed
                    }
                    committer.markBatchFinished();
                })
                .using((boolean success, String message, Throwable error) -> {
                    if (!success) {
                        failure.set(error != null ? error : new IllegalStateException(message));
                    }
                    stopped.countDown();
                })
                .build();

        ExecutorService executor = Executors.newSingleThreadExecutor();
        executor.execute(engine);
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            try {
                engine.close();
                stopped.await(120, TimeUnit.SECONDS);
            } catch (Exception ignored) {
                // the JVM is going down; the engine's offsets were flushed or the run is lost
            }
        }));
        System.out.println("READY");
        System.out.flush();
        InputStream in = System.in;
        byte[] buffer = new byte[256];
        while (stopped.getCount() > 0 && in.read(buffer) >= 0) {
            // until the controlling process closes our input
        }
        engine.close();
        stopped.await();
        executor.shutdown();
        json.close();
        if (failure.get() != null) {
            System.err.println("Debezium's engine failed:");
            failure.get().printStackTrace();
            Runtime.getRuntime().halt(1);
        }
        Runtime.getRuntime().halt(0);
    }
}
