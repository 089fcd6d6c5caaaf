"""An independent, read-only reader of the replog storage format (version 3).

Written only from docs/FORMAT.md, as an interoperability check.  It reads a log
stored on the local filesystem.  Dependencies: the standard library and pyarrow.

    read_log(path) -> {"log_id", "shards", "version", "heads", "lows", "events"}

Usage: python format_reader.py <log directory>

Amended where FORMAT.md was made precise (issue 35): a header of another log is unusable,
a header whose commit is gone or another's is passed over ("Finding the head", step 5),
a compaction covers exactly what it removes, low watermarks only come with truncations;
(issue 40, revision 3.3) a missing commit with a later one existing is damage (step 6).
It does not know key compaction's holed entries (added to the format later).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import warnings
from collections import namedtuple

import pyarrow as pa
import pyarrow.ipc as ipc

READER_FORMAT_VERSION = 3
DEFAULT_SNAPSHOT_INTERVAL = 100
GC_MARKS_KEPT = 64
SINK_HISTORY_KEPT = 64
OPERATIONS = ("insert", "update", "delete", "bulk")


# --------------------------------------------------------------------------- errors


class ReplogFormatError(Exception):
    """Base class of this reader's errors."""


class CorruptionError(ReplogFormatError):
    """A file of the log is damaged (its message names the file)."""


class UpgradeRequiredError(ReplogFormatError):
    """A record was written with a newer format_version than this reader's."""


class RecreatedLogError(ReplogFormatError):
    """A record names another log_id: the log was deleted and another created."""


class UnrecoverableLogError(ReplogFormatError):
    """The state cannot be rebuilt (e.g. retention removed what is needed)."""


class _NoUsableHeader(Exception):
    pass


class FormatWarning(UserWarning):
    pass


def _warn(msg):
    warnings.warn(msg, FormatWarning, stacklevel=3)


# ------------------------------------------------------------------- sealed JSON


class _DuplicateKey(ValueError):
    pass


def _no_float(text):
    raise ValueError("non-integer number %r" % text)


def _no_constant(text):
    raise ValueError("invalid constant %r" % text)


def _pairs(pairs):
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise _DuplicateKey("duplicate member %r" % k)
        obj[k] = v
    return obj


def _parse_strict_json(data: bytes, name: str):
    """Parse bytes as JSON with integers only; errors are corruption of `name`."""
    try:
        text = data.decode("utf-8")
        return json.loads(text, parse_float=_no_float, parse_constant=_no_constant,
                          object_pairs_hook=_pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptionError("%s: malformed JSON record: %s" % (name, exc)) from None


_SIMPLE_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n",
                   "\f": "\\f", "\r": "\\r"}


def _canon_str(s: str) -> str:
    out = ['"']
    for ch in s:
        esc = _SIMPLE_ESCAPES.get(ch)
        if esc is not None:
            out.append(esc)
            continue
        o = ord(ch)
        if 0x20 <= o <= 0x7E:
            out.append(ch)
        elif o > 0xFFFF:
            o -= 0x10000
            out.append("\\u%04x\\u%04x" % (0xD800 + (o >> 10), 0xDC00 + (o & 0x3FF)))
        else:
            out.append("\\u%04x" % o)
    out.append('"')
    return "".join(out)


def canonical_json(value) -> str:
    """The canonical form of FORMAT.md "Sealed JSON records"."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _canon_str(value)
    if isinstance(value, list):
        return "[" + ",".join(canonical_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(_canon_str(k) + ":" + canonical_json(value[k])
                              for k in sorted(value)) + "}"
    raise ValueError("not representable in a sealed record: %r" % (value,))


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def check_seal(obj, name, version_member="format_version",
               max_version=READER_FORMAT_VERSION):
    """Steps (1)-(3) of the sealed-record check on a parsed object."""
    if not isinstance(obj, dict):
        raise CorruptionError("%s: not a JSON object" % name)
    ver = obj.get(version_member)
    if not _is_int(ver):
        raise CorruptionError("%s: missing or non-integer %r" % (name, version_member))
    if ver > max_version:
        raise UpgradeRequiredError("%s: written with format_version %d; upgrade"
                                   % (name, ver))
    recorded = obj.get("checksum")
    if not isinstance(recorded, str):
        raise CorruptionError("%s: missing checksum" % name)
    body = {k: v for k, v in obj.items() if k != "checksum"}
    try:
        canon = canonical_json(body)
    except ValueError as exc:
        raise CorruptionError("%s: %s" % (name, exc)) from None
    computed = hashlib.sha256(canon.encode("ascii")).hexdigest()
    if computed != recorded:
        raise CorruptionError("%s: checksum mismatch: recorded %s, computed %s"
                              % (name, recorded, computed))
    return obj


def read_sealed(fs_path, name, version_member="format_version"):
    """Read and check a sealed record; FileNotFoundError when it is missing."""
    with open(fs_path, "rb") as f:
        data = f.read()
    return check_seal(_parse_strict_json(data, name), name, version_member)


# ------------------------------------------------------------------ segment entries

Entry = namedtuple("Entry", "path shard first last bytes sha256 min_ts max_ts offset")


def _entry_key(e):
    return (e.shard, e.path, e.offset)


def _valid_rel_path(p):
    if not isinstance(p, str) or not p or p.startswith("/") or "\\" in p:
        return False
    return all(part not in ("", ".", "..") for part in p.split("/"))


def _check_entry(e: Entry, shards: int, name: str) -> Entry:
    if not _valid_rel_path(e.path):
        raise CorruptionError("%s: bad segment path %r" % (name, e.path))
    if not (isinstance(e.sha256, str) and re.fullmatch(r"[0-9a-f]{64}", e.sha256)):
        raise CorruptionError("%s: bad sha256 for %s" % (name, e.path))
    for f in ("shard", "first", "last", "bytes", "min_ts", "max_ts", "offset"):
        if not _is_int(getattr(e, f)):
            raise CorruptionError("%s: non-integer %s in entry for %s" % (name, f, e.path))
    if not 0 <= e.shard < shards:
        raise CorruptionError("%s: shard %d out of range in entry for %s"
                              % (name, e.shard, e.path))
    if e.first < 1 or e.last < e.first or e.offset < 0 or e.bytes < 0:
        raise CorruptionError("%s: bad sequence range/offset in entry for %s (%d..%d, offset %d)"
                              % (name, e.path, e.first, e.last, e.offset))
    return e


def _record_entries(lst, record_format, shards, name, member):
    """Entries of a commit's add/remove list, in list order."""
    if lst is None:
        return []
    if not isinstance(lst, list):
        raise CorruptionError("%s: %r is not a list" % (name, member))
    out = []
    for item in lst:
        if not isinstance(item, dict):
            raise CorruptionError("%s: malformed %r item" % (name, member))
        if record_format >= 3:
            parts = item.get("parts")
            if not isinstance(parts, list):
                raise CorruptionError("%s: %r file without parts" % (name, member))
            for part in parts:
                if not (isinstance(part, list) and len(part) == 7
                        and all(_is_int(x) for x in part)):
                    raise CorruptionError("%s: malformed part %r of %r"
                                          % (name, part, item.get("path")))
                shard, first, last, offset, nbytes, mn, mx = part
                out.append(_check_entry(Entry(item.get("path"), shard, first, last, nbytes,
                                              item.get("sha256"), mn, mx, offset),
                                        shards, name))
        else:
            try:
                e = Entry(item["path"], item["shard"], item["first_sequence"],
                          item["last_sequence"], item["bytes"], item["sha256"],
                          item["min_timestamp_ms"], item["max_timestamp_ms"],
                          item.get("offset", 0))
            except KeyError as exc:
                raise CorruptionError("%s: segment entry lacks %s" % (name, exc)) from None
            out.append(_check_entry(e, shards, name))
    return out


# --------------------------------------------------------------------------- state


class State:
    def __init__(self, version, shards):
        self.version = version
        self.heads = [0] * shards
        self.lows = [1] * shards
        self.live = [dict() for _ in range(shards)]  # (path, offset) -> Entry
        self.sinks = {}
        self.gc_marks = []
        self.source = "empty log"  # what the segments were built from (for errors)


class LogReader:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.meta = os.path.join(self.root, "_replog")
        self._rejected = set()  # headers that are not the commits' history (step 5)
        self._read_descriptor()

    # ---- paths

    def _p(self, rel):
        return os.path.join(self.root, *rel.split("/"))

    @staticmethod
    def commit_rel(v):
        return "_replog/commits/%020d.json" % v

    @staticmethod
    def header_rel(v):
        return "_replog/snapshots/%020d.json" % v

    @staticmethod
    def table_rel(v):
        return "_replog/snapshots/%020d.segments.arrow" % v

    @staticmethod
    def changes_rel(v):
        return "_replog/snapshots/%020d.changes.arrow" % v

    def _exists(self, rel):
        return os.path.isfile(self._p(rel))

    # ---- descriptor

    def _read_descriptor(self):
        rel = "_replog/log.json"
        try:
            d = read_sealed(self._p(rel), rel)
        except FileNotFoundError:
            raise ReplogFormatError("%s: no replog log here (missing %s)"
                                    % (self.root, rel)) from None
        shards = d.get("shards")
        if not _is_int(shards) or not 1 <= shards <= 4096:
            raise CorruptionError("%s: bad shards %r" % (rel, shards))
        log_id = d.get("log_id")
        if not isinstance(log_id, str) or not log_id:
            raise CorruptionError("%s: bad log_id %r" % (rel, log_id))
        s = d.get("snapshot_interval", DEFAULT_SNAPSHOT_INTERVAL)
        if not _is_int(s) or s < 1:
            raise CorruptionError("%s: bad snapshot_interval %r" % (rel, s))
        c = d.get("checkpoint_interval", s)
        if not _is_int(c) or c < 1 or s % c:
            raise CorruptionError("%s: bad checkpoint_interval %r (snapshot_interval %r)"
                                  % (rel, c, s))
        fmt = d.get("segment_format", "arrow-ipc-file")
        if fmt != "arrow-ipc-file":
            raise ReplogFormatError("%s: unsupported segment_format %r" % (rel, fmt))
        routing = d.get("routing")
        if routing != "fnv1a64-utf8-mod-shards":
            _warn("%s: unknown routing %r (irrelevant for reading)" % (rel, routing))
        self.descriptor = d
        self.shards = shards
        self.log_id = log_id
        self.S = s
        self.C = c

    def _check_log_id(self, rec, name):
        lid = rec.get("log_id")
        if lid is None or lid == "":
            return
        if not isinstance(lid, str):
            raise CorruptionError("%s: bad log_id %r" % (name, lid))
        if lid != self.log_id:
            raise RecreatedLogError(
                "%s names log_id %s but the descriptor names %s: the log was deleted "
                "and another created at %s (re-created log)"
                % (name, lid, self.log_id, self.root))

    # ---- headers

    def _validate_header(self, hdr, h, name):
        if hdr.get("version") != h:
            raise CorruptionError("%s: version %r does not match the file name"
                                  % (name, hdr.get("version")))
        try:
            self._check_log_id(hdr, name)
        except RecreatedLogError:
            # FORMAT.md "Finding the head", step 3: written late by a writer of a log
            # deleted here before, unless the descriptor, read again, changed too
            if LogReader(self.root).log_id != self.log_id:
                raise
            raise CorruptionError("%s: a header of another log" % name) from None
        if "shards" in hdr and hdr["shards"] != self.shards:
            raise CorruptionError("%s: shards %r differs from the descriptor's %d"
                                  % (name, hdr["shards"], self.shards))
        for member in ("heads", "lows"):
            m = hdr.get(member, {})
            if not isinstance(m, dict):
                raise CorruptionError("%s: %s is not an object" % (name, member))
            for k, v in m.items():
                if not (re.fullmatch(r"0|[1-9][0-9]*", k) and int(k) < self.shards
                        and _is_int(v) and v >= 0):
                    raise CorruptionError("%s: bad %s member %r: %r" % (name, member, k, v))
        heads = hdr.get("heads", {})
        lows = hdr.get("lows", {})
        for s in range(self.shards):
            head = heads.get(str(s), 0)
            low = lows.get(str(s), 1)
            if low < 1 or low > head + 1:
                raise CorruptionError("%s: shard %d low %d / head %d inconsistent"
                                      % (name, s, low, head))
        return hdr

    def _read_header(self, h, copy=None):
        """The validated header h, or None if it is missing or corrupt (warned)."""
        name = self.header_rel(h)
        if h in self._rejected:
            _warn("%s: unusable (its commit is not the one it describes)" % name)
            return None
        if copy is not None:
            try:
                return self._validate_header(copy, h, name + " (hint copy)")
            except CorruptionError as exc:
                _warn("ignoring the hint's copy: %s" % exc)
        try:
            hdr = read_sealed(self._p(name), name)
        except FileNotFoundError:
            _warn("%s: missing" % name)
            return None
        except CorruptionError as exc:
            _warn("unusable header: %s" % exc)
            return None
        try:
            return self._validate_header(hdr, h, name)
        except CorruptionError as exc:
            _warn("unusable header: %s" % exc)
            return None

    def _state_from_header_fields(self, hdr, version):
        st = State(version, self.shards)
        heads = hdr.get("heads", {})
        lows = hdr.get("lows", {})
        st.heads = [heads.get(str(s), 0) for s in range(self.shards)]
        st.lows = [lows.get(str(s), 1) for s in range(self.shards)]
        sinks = hdr.get("sinks") or {}
        st.sinks = json.loads(json.dumps(sinks)) if isinstance(sinks, dict) else {}
        marks = hdr.get("gc_marks") or []
        st.gc_marks = [list(m) for m in marks if isinstance(m, list)]
        return st

    # ---- tables and changes files

    def _read_checked_arrow(self, rel, digest):
        """The Arrow table of a snapshot file whose digest must be `digest`, or None
        (warned) when missing or mismatching."""
        if not isinstance(digest, str):
            _warn("%s: no digest recorded for it" % rel)
            return None
        try:
            with open(self._p(rel), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            _warn("%s: missing" % rel)
            return None
        found = hashlib.sha256(data).hexdigest()
        if found != digest:
            _warn("%s: checksum mismatch: expected %s, found %s" % (rel, digest, found))
            return None
        try:
            return ipc.open_file(pa.BufferReader(data)).read_all()
        except Exception as exc:  # digest holds, but the writer wrote garbage
            raise CorruptionError("%s: not a readable Arrow IPC file: %s" % (rel, exc)) from None

    _TABLE_COLUMNS = ("path", "shard", "first_sequence", "last_sequence", "bytes", "sha256",
                      "min_timestamp_ms", "max_timestamp_ms")

    def _table_rows(self, table, rel):
        missing = [c for c in self._TABLE_COLUMNS if c not in table.column_names]
        if missing:
            raise CorruptionError("%s: lacks columns %s" % (rel, missing))
        cols = {c: table.column(c).to_pylist() for c in table.column_names}
        n = table.num_rows
        offsets = cols.get("offset", [0] * n)
        for i in range(n):
            vals = [cols[c][i] for c in self._TABLE_COLUMNS]
            if any(v is None for v in vals) or offsets[i] is None:
                raise CorruptionError("%s: null in row %d" % (rel, i))
            e = Entry(vals[0], vals[1], vals[2], vals[3], vals[4], vals[5], vals[6],
                      vals[7], offsets[i])
            yield i, _check_entry(e, self.shards, rel), cols

    def _load_table(self, t, digest):
        """Live entries of segment table t, or None when unusable (warned)."""
        rel = self.table_rel(t)
        table = self._read_checked_arrow(rel, digest)
        if table is None:
            return None
        live = [dict() for _ in range(self.shards)]
        has_change = "change" in table.column_names
        for i, e, cols in self._table_rows(table, rel):
            change = cols["change"][i] if has_change else "live"
            if change == "removed":
                continue  # tombstone
            if change != "live":
                raise CorruptionError("%s: unknown change %r in row %d" % (rel, change, i))
            key = (e.path, e.offset)
            if key in live[e.shard]:
                raise CorruptionError("%s: duplicate entry %s" % (rel, key))
            live[e.shard][key] = e
        return live

    def _apply_changes(self, live, table, rel):
        if "change" in table.column_names:
            kind = lambda cols, i: cols["change"][i]  # noqa: E731
        elif "removed" in table.column_names:
            kind = lambda cols, i: "removed" if cols["removed"][i] else "added"  # noqa: E731
        else:
            raise CorruptionError("%s: neither a change nor a removed column" % rel)
        added = []
        for i, e, cols in self._table_rows(table, rel):
            k = kind(cols, i)
            if k is None:
                raise CorruptionError("%s: null change in row %d" % (rel, i))
            if k == "removed":
                if live[e.shard].pop((e.path, e.offset), None) is None:
                    raise CorruptionError("%s: removed segment %s (shard %d, offset %d) is "
                                          "not in the table below it" % (rel, e.path, e.shard,
                                                                          e.offset))
            elif k == "added":
                added.append(e)
            elif k == "dropped":
                continue
            else:
                raise CorruptionError("%s: unknown change %r in row %d" % (rel, k, i))
        for e in added:
            key = (e.path, e.offset)
            if key in live[e.shard]:
                raise CorruptionError("%s: added segment %s is already live" % (rel, key))
            live[e.shard][key] = e
        return live

    def _direct_state(self, h, hdr):
        """State at header h from its own table or changes file (+ table below), or
        None when those are unusable."""
        if h == 0:
            return State(0, self.shards)
        if h % self.S == 0:
            digest = hdr.get("table_sha256", hdr.get("segments_sha256"))
            live = self._load_table(h, digest)
            if live is None:
                return None
            st = self._state_from_header_fields(hdr, h)
            st.live = live
            st.source = self.table_rel(h)
            return st
        ch = hdr.get("changes")
        if not isinstance(ch, dict):
            return None
        t = ch.get("table_version")
        if t != h - h % self.S:
            _warn("%s: changes entry names table %r, expected %d"
                  % (self.header_rel(h), t, h - h % self.S))
            return None
        rel = self.changes_rel(h)
        changes = self._read_checked_arrow(rel, ch.get("sha256"))
        if changes is None:
            return None
        if t == 0:
            live = [dict() for _ in range(self.shards)]
        else:
            live = self._load_table(t, ch.get("table_sha256"))
            if live is None:
                return None
        live = self._apply_changes(live, changes, rel)
        st = self._state_from_header_fields(hdr, h)
        st.live = live
        st.source = rel if t == 0 else "%s (applied to %s)" % (rel, self.table_rel(t))
        return st

    def _fallback_state(self, h):
        """The newest usable table below what header h offered, else version 0."""
        t = h - h % self.S if h % self.S else h - self.S
        while t > 0:
            hdr = self._read_header(t)
            if hdr is not None:
                digest = hdr.get("table_sha256", hdr.get("segments_sha256"))
                live = self._load_table(t, digest)
                if live is not None:
                    st = self._state_from_header_fields(hdr, t)
                    st.live = live
                    st.source = self.table_rel(t)
                    return st
            t -= self.S
        if not self._exists(self.commit_rel(1)):
            raise UnrecoverableLogError(
                "%s: no usable segment table or changes file at or below version %d, and "
                "commit 1 is gone (retention): the log cannot be rebuilt"
                % (self.root, h))
        return State(0, self.shards)

    # ---- commits

    def _read_commit(self, v):
        """The validated commit record v, or None if it does not exist."""
        rel = self.commit_rel(v)
        try:
            rec = read_sealed(self._p(rel), rel)
        except FileNotFoundError:
            return None
        if rec.get("version") != v:
            raise CorruptionError("%s: version %r does not match the file name"
                                  % (rel, rec.get("version")))
        self._check_log_id(rec, rel)
        return rec

    def _apply_commit(self, st: State, rec, v):
        name = self.commit_rel(v)
        fmt = rec["format_version"]
        op = rec.get("operation")
        add = _record_entries(rec.get("add", []), fmt, self.shards, name, "add")
        remove = _record_entries(rec.get("remove", []), fmt, self.shards, name, "remove")
        heads, lows, live = st.heads, st.lows, st.live

        def take(e):
            cur = live[e.shard].get((e.path, e.offset))
            if cur is None:
                raise CorruptionError("%s: remove names %s (shard %d, offset %d), which is "
                                      "not a live segment" % (name, e.path, e.shard, e.offset))
            if (cur.first, cur.last) != (e.first, e.last):
                raise CorruptionError("%s: remove of %s offset %d names sequences %d..%d, "
                                      "live entry has %d..%d" % (name, e.path, e.offset,
                                                                 e.first, e.last,
                                                                 cur.first, cur.last))
            del live[e.shard][(e.path, e.offset)]
            return cur

        def put(e):
            key = (e.path, e.offset)
            if key in live[e.shard]:
                raise CorruptionError("%s: adds %s offset %d, already live" % (name, e.path,
                                                                             e.offset))
            live[e.shard][key] = e

        if "gc" in rec:
            gc = rec["gc"]
            if op != "append" or add or not isinstance(gc, dict) \
                    or not _is_int(gc.get("cutoff_ms")):
                raise CorruptionError("%s: malformed gc mark" % name)
        if op != "truncate" and rec.get("low_watermarks"):
            raise CorruptionError("%s: low_watermarks in a %r commit" % (name, op))
        if op == "append":
            if remove:
                raise CorruptionError("%s: append with a non-empty remove" % name)
            for e in add:
                if e.first != heads[e.shard] + 1:
                    raise CorruptionError(
                        "%s: gap in sequences: shard %d head %d, entry %s starts at %d"
                        % (name, e.shard, heads[e.shard], e.path, e.first))
                heads[e.shard] = e.last
                put(e)
        elif op == "compact":
            removed = {}
            for e in remove:
                removed.setdefault(e.shard, []).append(take(e))
            added = {}
            for e in add:
                added.setdefault(e.shard, []).append(e)
            for s in set(removed) | set(added):
                r, a = removed.get(s, []), added.get(s, [])

                def cover(es):
                    # each sequence once: sorted runs, adjacent ones joined
                    runs = []
                    for x in sorted(es, key=lambda x: x.first):
                        if runs and x.first <= runs[-1][1]:
                            return "overlapping"
                        if runs and x.first == runs[-1][1] + 1:
                            runs[-1][1] = x.last
                        else:
                            runs.append([x.first, x.last])
                    return runs
                if cover(r) != cover(a) or cover(a) == "overlapping":
                    raise CorruptionError(
                        "%s: compact of shard %d adds sequences %s but removes %s "
                        "(each removed sequence, exactly once)" % (name, s, cover(a), cover(r)))
            for e in add:
                put(e)
        elif op == "truncate":
            if add:
                raise CorruptionError("%s: truncate with a non-empty add" % name)
            lw = rec.get("low_watermarks", {})
            if not isinstance(lw, dict):
                raise CorruptionError("%s: bad low_watermarks" % name)
            for k, new in lw.items():
                if not (re.fullmatch(r"0|[1-9][0-9]*", k) and int(k) < self.shards
                        and _is_int(new)):
                    raise CorruptionError("%s: bad low watermark %r: %r" % (name, k, new))
                s = int(k)
                low = max(lows[s], new)
                if low > heads[s] + 1:
                    raise CorruptionError("%s: low watermark %d of shard %d above head %d + 1"
                                          % (name, low, s, heads[s]))
                lows[s] = low
            for e in remove:
                cur = take(e)
                if cur.last >= lows[e.shard]:
                    raise CorruptionError(
                        "%s: truncate removes %s (shard %d, %d..%d), not wholly below the "
                        "low watermark %d" % (name, e.path, e.shard, cur.first, cur.last,
                                              lows[e.shard]))
        else:
            raise CorruptionError("%s: unknown operation %r" % (name, op))

        writer = rec.get("writer")
        if writer is not None:
            self._apply_writer(st, writer, v, name)
        if "gc" in rec:
            st.gc_marks.append([v, rec["gc"]["cutoff_ms"]])
            st.gc_marks = st.gc_marks[-GC_MARKS_KEPT:]
        st.version = v

    @staticmethod
    def _apply_writer(st, w, v, name):
        if not (isinstance(w, dict) and isinstance(w.get("sink_id"), str)
                and isinstance(w.get("query_id"), str) and _is_int(w.get("epoch"))):
            raise CorruptionError("%s: malformed writer %r" % (name, w))
        gen = w.get("generation", 0)
        if gen is None:
            gen = 0
        if not _is_int(gen):
            raise CorruptionError("%s: malformed writer generation" % name)
        mark = st.sinks.get(w["sink_id"])
        if not isinstance(mark, dict):
            mark = {"generation": 0, "queries": [], "runs": []}
        queries = [list(q) for q in mark.get("queries") or []]
        prev = [q for q in queries if q and q[0] == w["query_id"]]
        epoch = max([w["epoch"]] + [q[1] for q in prev if len(q) > 1 and _is_int(q[1])])
        queries = [q for q in queries if not (q and q[0] == w["query_id"])]
        queries.append([w["query_id"], epoch])
        runs = [list(r) for r in mark.get("runs") or []]
        if w.get("run_id") is not None:
            runs = [r for r in runs if not (r and r[0] == w["run_id"])]
            runs.append([w["run_id"], gen])
        old_gen = mark.get("generation") or 0
        st.sinks[w["sink_id"]] = {
            "query_id": w["query_id"], "epoch": w["epoch"], "version": v,
            "generation": max(old_gen if _is_int(old_gen) else 0, gen),
            "queries": queries[-SINK_HISTORY_KEPT:], "runs": runs[-SINK_HISTORY_KEPT:]}

    # ---- finding the head

    def _read_hint(self):
        rel = "_replog/_last_snapshot"
        try:
            with open(self._p(rel), "rb") as f:
                obj = json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError):
            return None, None
        if not isinstance(obj, dict) or not _is_int(obj.get("version")) or obj["version"] < 0:
            return None, None
        copy = obj.get("copy")
        return obj["version"], copy if isinstance(copy, dict) else None

    def _gallop(self):
        h, step = 0, self.C
        while self._exists(self.header_rel(h + step)):
            h += step
            step *= 2
        if h == 0 and not self._exists(self.commit_rel(1)):
            # repair path: list the snapshots directory
            snap = os.path.join(self.meta, "snapshots")
            try:
                names = os.listdir(snap)
            except OSError:
                names = []
            versions = [int(n[:20]) for n in names if re.fullmatch(r"[0-9]{20}\.json", n)]
            if versions:
                h = max(versions)
        return h

    def _usable_copy(self, copy, n, h):
        if copy is None or n != h:
            return None
        try:
            check_seal(copy, self.header_rel(h) + " (hint copy)")
        except ReplogFormatError:
            return None
        if copy.get("version") != n:
            return None
        return copy

    def _try_jump(self, version):
        """Lagging hint: the newest header past `version` whose own table or changes
        file is usable, or None."""
        k = (version // self.C + 1) * self.C
        found = []
        while self._exists(self.header_rel(k)):
            found.append(k)
            k += self.C
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FormatWarning)
            for k in reversed(found):
                hdr = self._read_header(k)
                if hdr is None:
                    continue
                st = self._direct_state(k, hdr)
                if st is not None:
                    return st
        return None

    def _initial_state(self, h, copy, from_hint):
        """Steps 2-3: the state of the newest usable header at or below h (rounded
        down to a multiple of C), with its header (None for the empty state)."""
        h -= h % self.C
        hdr = None
        hv = h
        while hv > 0:
            hdr = self._read_header(hv, copy if hv == h else None)
            if hdr is not None:
                break
            hv -= self.C
        if hdr is None:
            if not self._exists(self.commit_rel(1)) and (h > 0 or from_hint):
                raise _NoUsableHeader(
                    "%s: no usable snapshot header at or below %s and commit 1 is gone "
                    "(retention): the log cannot be rebuilt" % (self.root, self.header_rel(h)))
            if h > 0:
                _warn("no usable snapshot header at or below %d: reading from version 1" % h)
            elif not from_hint and not self._exists(self.commit_rel(1)):
                # repair path found no header at all: an empty log has no commits either
                cdir = os.path.join(self.meta, "commits")
                names = os.listdir(cdir) if os.path.isdir(cdir) else []
                if any(re.fullmatch(r"[0-9]{20}\.json", n) for n in names) and not (
                    self._exists(self.commit_rel(1))  # landed since (a new log)
                ):
                    raise UnrecoverableLogError(
                        "%s: commit 1 is gone (retention) and no snapshot header is left: "
                        "the log cannot be rebuilt" % self.commit_rel(1))
            return State(0, self.shards), None
        st = self._direct_state(hv, hdr)
        if st is None:
            _warn("%s: no usable table or changes file; falling back" % self.header_rel(hv))
            st = self._fallback_state(hv)
        return st, hdr

    def load_state(self, start=None) -> State:
        n, copy = self._read_hint() if start is None else (start, None)
        try:
            if n is None:
                raise _NoUsableHeader("no hint")
            copy = self._usable_copy(copy, n, n - n % self.C)
            st, hdr = self._initial_state(n, copy, True)
        except _NoUsableHeader:
            # a missing hint, or a stale one whose headers retention deleted: gallop
            # (and, on the repair path, list the snapshots directory)
            h = self._gallop()
            try:
                st, hdr = self._initial_state(h, None, False)
            except _NoUsableHeader as exc:
                raise UnrecoverableLogError(str(exc)) from None
        hv = hdr["version"] if hdr is not None else 0
        required = hv  # the state must reach at least the header's version
        required_hdr = hdr

        # step 4: commits after the state, jumping over a lagging hint
        C = self.C
        while True:
            batch = []
            for v in range(st.version + 1, st.version + 1 + C):
                rec = self._read_commit(v)
                if rec is None:
                    break
                batch.append((v, rec))
            if len(batch) == C:
                jumped = self._try_jump(st.version)
                if jumped is not None:
                    st = jumped
                    continue
            for v, rec in batch:
                self._apply_commit(st, rec, v)
                if v == required and required_hdr is not None:
                    self._compare_with_header(st, required_hdr)
            if len(batch) < C:
                break
        # step 6: a missing commit with a later one existing is damage, never the head
        missing = st.version + 1
        later = [v for v in range(missing + 1, missing + 1 + C)
                 if self._exists(self.commit_rel(v))]
        if later and not self._exists(self.commit_rel(missing)):
            snap = os.path.join(self.meta, "snapshots")
            above = sorted(int(n[:20]) for n in os.listdir(snap)
                           if re.fullmatch(r"[0-9]{20}\.json", n) and int(n[:20]) >= missing)
            for h in reversed(above):
                if self._read_header(h) is not None:
                    _warn("%s: missing, but header %d holds the state past it"
                          % (self.commit_rel(missing), h))
                    return self.load_state(h)
            raise CorruptionError("%s: commit %d is missing, but commit %d exists (damage)"
                                  % (self.commit_rel(missing), missing, later[0]))
        if hdr is not None and st.version == hv > 0:
            # step 5: no commit past header hv; its own commit must be the one it describes
            rec = self._read_commit(hv)
            if rec is None or ("token" in hdr and rec.get("token") != hdr["token"]):
                snap = os.path.join(self.meta, "snapshots")
                newer = [int(n[:20]) for n in os.listdir(snap)
                         if re.fullmatch(r"[0-9]{20}\.json", n) and int(n[:20]) > hv]
                self._rejected.add(hv)  # a newer one is taken, or none: hv is unusable
                return self.load_state(max(newer) if newer else None)
        if st.version < required:
            raise UnrecoverableLogError(
                "%s: missing: replaying from %s stopped at version %d, below header %d"
                % (self.commit_rel(st.version + 1), st.source, st.version, required))
        self._check_tiling(st)
        return st

    def _compare_with_header(self, st, hdr):
        name = self.header_rel(hdr["version"])
        h = self._state_from_header_fields(hdr, hdr["version"])
        if h.heads != st.heads or h.lows != st.lows:
            raise CorruptionError("%s: heads/lows %s/%s differ from the commits' %s/%s"
                                  % (name, h.heads, h.lows, st.heads, st.lows))

    def _check_tiling(self, st):
        for s in range(self.shards):
            head, low = st.heads[s], st.lows[s]
            entries = sorted(st.live[s].values(), key=lambda e: (e.first, e.last))
            need = low
            started = False
            for e in entries:
                if e.last < low:
                    continue  # wholly below the low watermark: never read
                if e.first > need or (started and e.first != need):
                    raise CorruptionError(
                        "%s: live segments of shard %d do not tile: expected sequence %d, "
                        "found %s covering %d..%d (gap or overlap)"
                        % (st.source, s, need, e.path, e.first, e.last))
                need = e.last + 1
                started = True
            if need != head + 1:
                raise CorruptionError(
                    "%s: live segments of shard %d cover up to %d but the head is %d"
                    % (st.source, s, need - 1, head))

    # ---- reading events

    def read_events(self, st: State):
        cache = {}
        events = []
        for s in range(self.shards):
            head, low = st.heads[s], st.lows[s]
            entries = sorted(st.live[s].values(), key=lambda e: e.first)
            for e in entries:
                a, b = max(low, e.first), min(head, e.last)
                if a > b:
                    continue
                table = self._segment(e, cache)
                n = e.last - e.first + 1
                if table.num_rows < e.offset + n:
                    raise CorruptionError(
                        "%s: has %d rows, the entry needs %d (offset %d, sequences %d..%d)"
                        % (e.path, table.num_rows, e.offset + n, e.offset, e.first, e.last))
                start = e.offset + (a - e.first)
                events.extend(self._rows(table.slice(start, b - a + 1), s, a, e.path))
        return events

    def _segment(self, e, cache):
        got = cache.get(e.path)
        if got is None:
            try:
                with open(self._p(e.path), "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                raise CorruptionError("%s: segment file missing" % e.path) from None
            digest = hashlib.sha256(data).hexdigest()
            try:
                table = ipc.open_file(pa.BufferReader(data)).read_all()
            except Exception as exc:
                table = exc
            got = cache[e.path] = (digest, table)
        digest, table = got
        if digest != e.sha256:
            raise CorruptionError("%s: checksum mismatch: expected %s, found %s"
                                  % (e.path, e.sha256, digest))
        if isinstance(table, Exception):
            raise CorruptionError("%s: not a readable Arrow IPC file: %s" % (e.path, table))
        return table

    _REQUIRED = ("event_id", "timestamp", "operation", "collection", "key", "data",
                 "metadata")

    def _rows(self, t, shard, first_seq, path):
        names = t.column_names
        missing = [c for c in self._REQUIRED if c not in names]
        if missing:
            raise CorruptionError("%s: lacks columns %s" % (path, missing))
        ts = t.column("timestamp")
        if not pa.types.is_timestamp(ts.type):
            raise CorruptionError("%s: timestamp column has type %s" % (path, ts.type))
        scale = {"s": 1_000_000, "ms": 1000, "us": 1, "ns": None}[ts.type.unit]
        raw = ts.cast(pa.int64()).to_pylist()
        if scale is None:
            tsv = [None if x is None else x // 1000 for x in raw]
        else:
            tsv = [None if x is None else x * scale for x in raw]
        cols = {c: t.column(c).to_pylist() for c in self._REQUIRED if c != "timestamp"}
        before = (t.column("before").to_pylist() if "before" in names
                  else [None] * t.num_rows)
        out = []
        for i in range(t.num_rows):
            ev = {"shard": shard, "sequence": first_seq + i,
                  "event_id": cols["event_id"][i], "timestamp": tsv[i],
                  "operation": cols["operation"][i], "collection": cols["collection"][i],
                  "key": cols["key"][i], "data": cols["data"][i], "before": before[i],
                  "metadata": cols["metadata"][i]}
            for c in ("event_id", "timestamp", "operation", "key", "data"):
                if ev[c] is None:
                    raise CorruptionError("%s: null %s in a non-nullable column" % (path, c))
            if ev["operation"] not in OPERATIONS:
                raise CorruptionError("%s: unknown operation %r" % (path, ev["operation"]))
            for c in ("data", "before"):
                if ev[c] is not None and not isinstance(ev[c], bytes):
                    raise CorruptionError("%s: %s is not binary" % (path, c))
            out.append(ev)
        return out


def read_log(path: str) -> dict:
    reader = LogReader(path)
    st = reader.load_state()
    events = reader.read_events(st)
    return {
        "log_id": reader.log_id,
        "shards": reader.shards,
        "version": st.version,
        "heads": {s: st.heads[s] for s in range(reader.shards)},
        "lows": {s: st.lows[s] for s in range(reader.shards)},
        "events": events,
    }


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: format_reader.py <log directory>", file=sys.stderr)
        return 2
    try:
        r = read_log(argv[0])
    except ReplogFormatError as exc:
        print("error: %s: %s" % (type(exc).__name__, exc), file=sys.stderr)
        return 1
    print("log_id:  %s" % r["log_id"])
    print("shards:  %d" % r["shards"])
    print("version: %d" % r["version"])
    print("heads:   %s" % [r["heads"][s] for s in range(r["shards"])])
    print("lows:    %s" % [r["lows"][s] for s in range(r["shards"])])
    print("events:  %d" % len(r["events"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
