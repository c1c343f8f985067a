"""Stored responses for the OpenAI Responses API (`store: true`, the API's default).

`POST /v1/responses` keeps each response with its input and output items so that `previous_response_id`
chains survive a server restart and `GET /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and
`DELETE /v1/responses/{id}` work. The store is an embedded SQLite database (a file, or memory for tests and
ephemeral servers); values are JSON in TEXT columns.

Tables (schema version in `PRAGMA user_version`, so a later change can migrate; a file written by a newer
version is refused, never guessed at):

- `responses (tenant, id, created_at, response, messages)`: the response object as returned to the client,
  and the internal conversation up to and including its output (opaque to the store).
- `input_items (tenant, response_id, seq, id, item)`: the request's input items in the order given, one row
  each, so `input_items` pages are read with an index rather than by decoding the whole input.
- `items (tenant, id, response_id, item)`: every item (input or output) a later request may reference by id,
  stored as the caller gave it (reasoning items carry private fields such as the thinking text). An item id
  can be put by several responses of a chain (an output item comes back as the next request's input), so a
  row is keyed by the response that put it too: deleting one response removes only what it put, and `item`
  returns the most recently put copy.

Retention: a response older than `retention_s` (default `DEFAULT_RETENTION_S`, 30 days, by the time it was
put) is expired: `get`, `item` and `list_input_items` treat it as absent at once, and `put` purges expired
rows now and then (every `_PURGE_EVERY_PUTS` puts or `_PURGE_EVERY_S` seconds), so reads never depend on a
purge having run.

Tenancy: every key starts with the tenant; no query reads across tenants, so one tenant never sees another's
responses or items, even with equal ids.

Thread-safety: the server calls the store from its threadpool, so there is one connection
(`check_same_thread=False`) and every use of it holds one `threading.Lock`; SQLite's own locking then only
matters for another process opening the same file (WAL lets its readers run beside a writer).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_RETENTION_S = 30 * 24 * 3600  # stated default retention: responses older than this are deleted
SCHEMA_VERSION = 1  # PRAGMA user_version of the files this module writes
_PURGE_EVERY_PUTS = 100
_PURGE_EVERY_S = 60.0
_MAX_LIMIT = 100  # OpenAI's list endpoints take limit 1..100

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    messages TEXT NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
CREATE TABLE IF NOT EXISTS input_items (
    tenant TEXT NOT NULL,
    response_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    id TEXT NOT NULL,
    item TEXT NOT NULL,
    PRIMARY KEY (tenant, response_id, seq)
);
CREATE TABLE IF NOT EXISTS items (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    response_id TEXT NOT NULL,
    item TEXT NOT NULL,
    PRIMARY KEY (tenant, id, response_id)
);
CREATE INDEX IF NOT EXISTS items_by_response ON items (tenant, response_id);
"""


class SchemaVersionError(RuntimeError):
    """The database file was written by a newer version of this store than this code supports."""


@dataclass
class StoredResponse:
    response: dict  # the response object as returned to the client (JSON)
    input_items: list[dict]  # the request's input items as given, each with an "id" (the caller assigns ids)
    messages: list[dict]  # the internal conversation up to and including this response's output (opaque JSON list)
    created_at: float


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _check_tenant(tenant: Any) -> None:
    # A None tenant would become SQL NULL, which never equals itself: rows that could be neither read nor deleted.
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a string, not {type(tenant).__name__}")


def _item_id(item: Any, what: str) -> str:
    if not isinstance(item, dict) or not isinstance(item.get("id"), str):
        raise ValueError(f"each of {what} must be a dict with a string 'id'")
    return item["id"]


def _create_private(path: Path) -> None:
    """Create the database file readable by its owner only (it holds users' conversations); SQLite gives its
    -wal and -shm files the database file's permissions. An existing file keeps its mode."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)  # exact, whatever the umask
    finally:
        os.close(fd)


class ResponseStore:
    """Stored Responses API responses and items, per tenant (see the module docstring)."""

    def __init__(self, path: str | os.PathLike | None = None, retention_s: float = DEFAULT_RETENTION_S):
        if not retention_s > 0:
            raise ValueError(f"retention_s must be positive, not {retention_s!r}")
        self.retention_s = float(retention_s)
        # The store's notion of now (time.time); tests replace it to move time without sleeping.
        self.clock: Callable[[], float] = time.time
        self._lock = threading.Lock()
        in_memory = path is None or os.fspath(path) == ":memory:"
        if in_memory:
            target = ":memory:"
        else:
            file = Path(path)
            file.parent.mkdir(parents=True, exist_ok=True)
            _create_private(file)
            target = os.fspath(file)
        self.path = None if in_memory else target
        # Autocommit mode: transactions are opened explicitly (`_write`), so none is left open by a read.
        self._conn: sqlite3.Connection | None = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
        try:
            self._open(in_memory)
        except BaseException:
            self._conn.close()
            self._conn = None
            raise
        self._puts_since_purge = 0
        # None: the first put purges, so a restart after a long stop soon drops what expired meanwhile (not here:
        # opening stays cheap, and `clock` can still be replaced before the first purge).
        self._last_purge: float | None = None

    def _open(self, in_memory: bool) -> None:
        conn = self._conn
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            # Checked before any other statement: a newer file is left exactly as it was.
            raise SchemaVersionError(f"response store {self.path} has schema version {version}, newer than the "
                                     f"{SCHEMA_VERSION} this Horizon supports: upgrade Horizon or use another file")
        if not in_memory:
            # WAL: readers (e.g. another process) do not block the writer; NORMAL is durable in WAL mode up to
            # the last checkpoint's worth of a power loss, and saves an fsync per commit.
            conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Statement by statement: executescript would COMMIT the open transaction first.
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            # Version 0 is a new file: it gets the current schema. Migrations from older versions go here.
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.ProgrammingError("the response store is closed")
        return self._conn

    def _write(self, body: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run `body` in one transaction (all of it or none of it); the caller holds the lock."""
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = body(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return result

    def _cutoff(self, now: float | None = None) -> float:
        """Rows created at or before this time are expired."""
        return (self.clock() if now is None else now) - self.retention_s

    def put(self, tenant: str, response: dict, input_items: list[dict], messages: list[dict],
            items: list[dict]) -> None:
        _check_tenant(tenant)
        if not isinstance(response, dict) or not isinstance(response.get("id"), str):
            raise ValueError("response must be a dict with a string 'id'")
        response_id = response["id"]
        # Serialise before taking the lock: the slow part, and a value that is not JSON fails before any write.
        inputs = [(seq, _item_id(item, "input_items"), _dumps(item)) for seq, item in enumerate(input_items)]
        stored = [(_item_id(item, "items"), _dumps(item)) for item in items]
        response_json, messages_json = _dumps(response), _dumps(messages)

        def body(conn: sqlite3.Connection) -> None:
            # Re-putting an id replaces the response and everything it put.
            self._delete_rows(conn, tenant, response_id)
            conn.execute("INSERT INTO responses (tenant, id, created_at, response, messages) VALUES (?, ?, ?, ?, ?)",
                         (tenant, response_id, now, response_json, messages_json))
            conn.executemany("INSERT INTO input_items (tenant, response_id, seq, id, item) VALUES (?, ?, ?, ?, ?)",
                             [(tenant, response_id, seq, iid, js) for seq, iid, js in inputs])
            # OR REPLACE: the same id twice in one put keeps the last, as a dict literal would.
            conn.executemany("INSERT OR REPLACE INTO items (tenant, id, response_id, item) VALUES (?, ?, ?, ?)",
                             [(tenant, iid, response_id, js) for iid, js in stored])

        with self._lock:
            now = self.clock()
            self._write(body)
            self._puts_since_purge += 1
            # abs(): a clock stepped backwards would otherwise postpone purges until it caught up.
            if (self._last_purge is None or self._puts_since_purge >= _PURGE_EVERY_PUTS
                    or abs(now - self._last_purge) >= _PURGE_EVERY_S):
                self._purge(now)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        _check_tenant(tenant)
        with self._lock:
            conn = self._connection()
            row = conn.execute("SELECT response, messages, created_at FROM responses "
                               "WHERE tenant = ? AND id = ? AND created_at > ?",
                               (tenant, response_id, self._cutoff())).fetchone()
            if row is None:
                return None
            inputs = conn.execute("SELECT item FROM input_items WHERE tenant = ? AND response_id = ? ORDER BY seq",
                                  (tenant, response_id)).fetchall()
        return StoredResponse(response=json.loads(row[0]), input_items=[json.loads(r[0]) for r in inputs],
                              messages=json.loads(row[1]), created_at=row[2])

    def item(self, tenant: str, item_id: str) -> dict | None:
        _check_tenant(tenant)
        with self._lock:
            # Expiry is the putting response's; of several live copies the most recently put wins (a later
            # response of a chain may have stored the item again).
            row = self._connection().execute(
                "SELECT i.item FROM items i JOIN responses r ON r.tenant = i.tenant AND r.id = i.response_id "
                "WHERE i.tenant = ? AND i.id = ? AND r.created_at > ? ORDER BY r.created_at DESC, i.rowid DESC "
                "LIMIT 1", (tenant, item_id, self._cutoff())).fetchone()
        return None if row is None else json.loads(row[0])

    @staticmethod
    def _delete_rows(conn: sqlite3.Connection, tenant: str, response_id: str) -> bool:
        conn.execute("DELETE FROM items WHERE tenant = ? AND response_id = ?", (tenant, response_id))
        conn.execute("DELETE FROM input_items WHERE tenant = ? AND response_id = ?", (tenant, response_id))
        return conn.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)).rowcount > 0

    def delete(self, tenant: str, response_id: str) -> bool:
        """Delete a response and the items it put; True if it existed (and had not expired)."""
        _check_tenant(tenant)
        with self._lock:
            cutoff = self._cutoff()

            def body(conn: sqlite3.Connection) -> bool:
                # An expired response is gone as far as clients know: deleting it says False, like `get`'s None.
                alive = conn.execute("SELECT 1 FROM responses WHERE tenant = ? AND id = ? AND created_at > ?",
                                     (tenant, response_id, cutoff)).fetchone() is not None
                return self._delete_rows(conn, tenant, response_id) and alive

            return self._write(body)

    def list_input_items(self, tenant: str, response_id: str, *, after: str | None = None, limit: int = 20,
                         order: str = "desc") -> tuple[list[dict], bool] | None:
        """A page of a response's input items, OpenAI's list semantics: `order` "desc" (last given first, the
        API's default) or "asc", starting after the item `after` (in that order), at most `limit` (1..100).
        None if the response does not exist for this tenant; else (items, has_more). ValueError for a bad
        `limit` or `order`, or an `after` that is not one of this response's input items."""
        _check_tenant(tenant)
        if order not in ("asc", "desc"):
            raise ValueError(f"order must be 'asc' or 'desc', not {order!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= _MAX_LIMIT:
            raise ValueError(f"limit must be an integer from 1 to {_MAX_LIMIT}, not {limit!r}")
        with self._lock:
            conn = self._connection()
            if conn.execute("SELECT 1 FROM responses WHERE tenant = ? AND id = ? AND created_at > ?",
                            (tenant, response_id, self._cutoff())).fetchone() is None:
                return None
            start = None
            if after is not None:
                # An id given twice: start after its first appearance in the listing order.
                first = "MIN" if order == "asc" else "MAX"
                start = conn.execute(f"SELECT {first}(seq) FROM input_items WHERE tenant = ? AND response_id = ? "
                                     "AND id = ?", (tenant, response_id, after)).fetchone()[0]
                if start is None:
                    raise ValueError(f"after: {after!r} is not an input item of response {response_id!r}")
            where, params = "tenant = ? AND response_id = ?", [tenant, response_id]
            if start is not None:
                where += " AND seq > ?" if order == "asc" else " AND seq < ?"
                params.append(start)
            # One row more than the page says whether there are more.
            rows = conn.execute(f"SELECT item FROM input_items WHERE {where} ORDER BY seq {order.upper()} LIMIT ?",
                                (*params, limit + 1)).fetchall()
        return [json.loads(r[0]) for r in rows[:limit]], len(rows) > limit

    def _purge(self, now: float) -> int:
        cutoff = now - self.retention_s

        def body(conn: sqlite3.Connection) -> int:
            expired = "SELECT tenant, id FROM responses WHERE created_at <= ?"
            conn.execute(f"DELETE FROM items WHERE (tenant, response_id) IN ({expired})", (cutoff,))
            conn.execute(f"DELETE FROM input_items WHERE (tenant, response_id) IN ({expired})", (cutoff,))
            return conn.execute("DELETE FROM responses WHERE created_at <= ?", (cutoff,)).rowcount

        removed = self._write(body)
        self._puts_since_purge = 0
        self._last_purge = now
        return removed

    def purge_expired(self, now: float | None = None) -> int:
        """Delete every response older than the retention (and its items); returns the responses removed."""
        with self._lock:
            return self._purge(self.clock() if now is None else now)

    def close(self) -> None:
        """Close the database (idempotent); SQLite checkpoints the WAL into the file as the last connection
        closes. Any later call raises sqlite3.ProgrammingError."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> ResponseStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
