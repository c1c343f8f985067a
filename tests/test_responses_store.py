"""`ResponseStore`, the SQLite store behind the Responses API's `store: true`: round trips, item lookup, tenant
isolation, a restart (close and reopen of the file), deletion, `input_items` paging, retention on a fake clock
(no sleeping), concurrent puts, and refusing a file from a newer schema version."""

from __future__ import annotations

import sqlite3
import stat
import threading

import pytest

from horizon.serving import responses_store
from horizon.serving.responses_store import DEFAULT_RETENTION_S, ResponseStore, SchemaVersionError, StoredResponse

T0 = 1_000_000.0


class Clock:
    """A settable stand-in for time.time."""

    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def response(rid: str, text: str = "hi") -> dict:
    return {"id": rid, "object": "response", "status": "completed",
            "output": [{"id": f"msg_{rid}", "type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": text}]}]}


def inputs(rid: str, n: int) -> list[dict]:
    return [{"id": f"in_{rid}_{i}", "type": "message", "role": "user", "content": f"turn {i}"} for i in range(n)]


def reasoning(iid: str, thinking: str = "secret thoughts") -> dict:
    return {"id": iid, "type": "reasoning", "summary": [], "thinking": thinking, "thinking_tier": "high"}


def put(store: ResponseStore, tenant: str, rid: str, n_inputs: int = 2, items: list[dict] | None = None) -> None:
    ins = inputs(rid, n_inputs)
    out = response(rid)
    store.put(tenant, out, ins, [{"role": "user", "content": rid}], ins + out["output"] + (items or []))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path, clock):
    s = ResponseStore(None if request.param == "memory" else tmp_path / "responses.db")
    s.clock = clock
    yield s
    s.close()


def test_put_get_round_trip(store, clock):
    out = response("resp_1", text="héllo ✓ 日本")
    ins = inputs("resp_1", 3)
    messages = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "✓", "extra": [1, None, 2.5]}]
    store.put("t", out, ins, messages, ins + out["output"])
    got = store.get("t", "resp_1")
    assert got == StoredResponse(response=out, input_items=ins, messages=messages, created_at=T0)
    assert store.get("t", "resp_2") is None


def test_json_is_stored_unescaped(tmp_path):
    path = tmp_path / "r.db"
    with ResponseStore(path) as s:
        s.put("t", response("resp_1", text="日本"), [], [], [])
    raw = sqlite3.connect(path).execute("SELECT response FROM responses").fetchone()[0]
    assert "日本" in raw  # ensure_ascii=False, not \\u escapes


def test_item_lookup(store):
    put(store, "t", "resp_1", items=[reasoning("rs_1")])
    assert store.item("t", "rs_1") == reasoning("rs_1")  # private fields kept as given
    assert store.item("t", "msg_resp_1")["type"] == "message"
    assert store.item("t", "in_resp_1_0")["content"] == "turn 0"
    assert store.item("t", "rs_2") is None


def test_item_only_if_put_in_items(store):
    # input_items are listed, but only `items` are looked up by id
    store.put("t", response("resp_1"), inputs("resp_1", 1), [], [])
    assert store.item("t", "in_resp_1_0") is None
    assert store.list_input_items("t", "resp_1") == (inputs("resp_1", 1), False)


def test_tenant_isolation(store):
    put(store, "alice", "resp_1", items=[reasoning("rs_1")])
    assert store.get("bob", "resp_1") is None
    assert store.item("bob", "rs_1") is None
    assert store.list_input_items("bob", "resp_1") is None
    assert store.delete("bob", "resp_1") is False
    # bob's own response with the same ids does not touch alice's
    put(store, "bob", "resp_1", items=[reasoning("rs_1", thinking="bob's")])
    assert store.item("bob", "rs_1")["thinking"] == "bob's"
    assert store.delete("bob", "resp_1") is True
    assert store.item("alice", "rs_1")["thinking"] == "secret thoughts"
    assert store.get("alice", "resp_1") is not None
    assert store.list_input_items("alice", "resp_1") == (inputs("resp_1", 2)[::-1], False)


def test_persists_across_restart(tmp_path):
    path = tmp_path / "nested" / "dir" / "responses.db"
    s = ResponseStore(path)
    put(s, "t", "resp_1", items=[reasoning("rs_1")])
    before = s.get("t", "resp_1")
    s.close()
    s.close()  # idempotent
    with pytest.raises(sqlite3.ProgrammingError):
        s.get("t", "resp_1")

    s = ResponseStore(path)
    assert s.get("t", "resp_1") == before
    assert s.item("t", "rs_1") == reasoning("rs_1")
    assert s.list_input_items("t", "resp_1", order="asc") == (inputs("resp_1", 2), False)
    s.close()


def test_file_settings(tmp_path):
    path = tmp_path / "a" / "b" / "responses.db"
    s = ResponseStore(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    put(s, "t", "resp_1")
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == responses_store.SCHEMA_VERSION
    conn.close()
    s.close()


def test_delete(store):
    put(store, "t", "resp_1", items=[reasoning("rs_1")])
    put(store, "t", "resp_2", items=[reasoning("rs_2")])
    assert store.delete("t", "resp_1") is True
    assert store.get("t", "resp_1") is None
    assert store.item("t", "rs_1") is None
    assert store.item("t", "msg_resp_1") is None
    assert store.list_input_items("t", "resp_1") is None
    assert store.delete("t", "resp_1") is False
    # the other response is untouched
    assert store.get("t", "resp_2") is not None
    assert store.item("t", "rs_2") is not None


def test_item_shared_by_a_chain_survives_deleting_one(store, clock):
    # an output item of resp_1 comes back as an input item of resp_2, and both put it
    put(store, "t", "resp_1", items=[reasoning("rs_1", thinking="v1")])
    clock.t += 1
    put(store, "t", "resp_2", items=[reasoning("rs_1", thinking="v2")])
    assert store.item("t", "rs_1")["thinking"] == "v2"  # the latest copy
    assert store.delete("t", "resp_2")
    assert store.item("t", "rs_1")["thinking"] == "v1"  # resp_1 still holds its own
    assert store.delete("t", "resp_1")
    assert store.item("t", "rs_1") is None


def test_reput_replaces(store, clock):
    put(store, "t", "resp_1", n_inputs=3, items=[reasoning("rs_old")])
    clock.t += 5
    store.put("t", response("resp_1", text="new"), inputs("resp_1", 1), [{"m": 1}], [reasoning("rs_new")])
    got = store.get("t", "resp_1")
    assert got.response["output"][0]["content"][0]["text"] == "new"
    assert got.input_items == inputs("resp_1", 1)
    assert got.messages == [{"m": 1}]
    assert got.created_at == T0 + 5
    assert store.item("t", "rs_old") is None
    assert store.item("t", "rs_new") is not None


def test_list_input_items_pages(store):
    put(store, "t", "resp_1", n_inputs=5)
    ids = [f"in_resp_1_{i}" for i in range(5)]

    def page(**kw):
        items, more = store.list_input_items("t", "resp_1", **kw)
        return [i["id"] for i in items], more

    assert page() == (ids[::-1], False)  # desc is the default
    assert page(order="asc") == (ids, False)
    assert page(order="asc", limit=2) == (ids[0:2], True)
    assert page(order="asc", limit=2, after=ids[1]) == (ids[2:4], True)
    assert page(order="asc", limit=2, after=ids[3]) == ([ids[4]], False)
    assert page(order="asc", limit=1, after=ids[4]) == ([], False)
    assert page(order="desc", limit=2) == ([ids[4], ids[3]], True)
    assert page(order="desc", limit=2, after=ids[3]) == ([ids[2], ids[1]], True)
    assert page(order="desc", limit=2, after=ids[1]) == ([ids[0]], False)
    assert page(order="desc", limit=3, after=ids[2]) == ([ids[1], ids[0]], False)
    assert page(order="asc", limit=5) == (ids, False)  # exactly a page: nothing more
    assert page(order="asc", limit=4) == (ids[:4], True)


def test_list_input_items_errors(store):
    put(store, "t", "resp_1")
    assert store.list_input_items("t", "resp_nope") is None
    for limit in (0, 101, -1, True, 2.0):
        with pytest.raises(ValueError, match="limit"):
            store.list_input_items("t", "resp_1", limit=limit)
    with pytest.raises(ValueError, match="order"):
        store.list_input_items("t", "resp_1", order="newest")
    with pytest.raises(ValueError, match="after"):
        store.list_input_items("t", "resp_1", after="in_unknown")
    assert store.list_input_items("t", "resp_1", limit=1)[1] is True
    assert len(store.list_input_items("t", "resp_1", limit=100)[0]) == 2


def test_retention_purge_with_explicit_now(tmp_path, clock):
    s = ResponseStore(tmp_path / "r.db", retention_s=100)
    s.clock = clock
    put(s, "t", "resp_old", items=[reasoning("rs_old")])
    clock.t = T0 + 60
    put(s, "u", "resp_new", items=[reasoning("rs_new")])
    assert s.purge_expired(now=T0 + 99) == 0
    assert s.purge_expired(now=T0 + 100) == 1  # exactly the retention old: expired
    clock.t = T0 + 100
    assert s.get("t", "resp_old") is None
    assert s.get("u", "resp_new") is not None
    assert s.item("u", "rs_new") is not None
    # the purge took the old response's items and input items with it, not only the response row
    conn = sqlite3.connect(tmp_path / "r.db")
    assert conn.execute("SELECT count(*) FROM items WHERE response_id = 'resp_old'").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM input_items WHERE response_id = 'resp_old'").fetchone()[0] == 0
    conn.close()
    assert s.purge_expired(now=T0 + 160) == 1
    assert s.purge_expired(now=T0 + 1e9) == 0
    s.close()


def test_expired_row_is_absent_before_any_purge(store, clock):
    store.retention_s = 100.0
    put(store, "t", "resp_1", items=[reasoning("rs_1")])
    clock.t = T0 + 99.5
    assert store.get("t", "resp_1") is not None
    assert store.item("t", "rs_1") is not None
    clock.t = T0 + 100
    assert store.get("t", "resp_1") is None
    assert store.item("t", "rs_1") is None
    assert store.list_input_items("t", "resp_1") is None
    assert store.delete("t", "resp_1") is False
    assert store.purge_expired() == 0  # delete removed the expired rows too


def test_puts_purge_now_and_then(store, clock):
    store.retention_s = 30.0  # shorter than the purge interval
    put(store, "t", "resp_old")  # the first put purges (nothing yet)
    clock.t = T0 + responses_store._PURGE_EVERY_S  # resp_old has expired, and the purge interval has passed
    assert store.get("t", "resp_old") is None
    put(store, "t", "resp_new")  # this put purges resp_old
    assert store.purge_expired(now=clock.t) == 0
    # within the interval, a burst of puts still purges once per _PURGE_EVERY_PUTS
    clock.t += 40  # resp_new has expired; 40 s since the last purge is under the interval
    assert 40 < responses_store._PURGE_EVERY_S
    for i in range(responses_store._PURGE_EVERY_PUTS):
        put(store, "t", f"resp_{i}", n_inputs=0)
    assert store.purge_expired(now=clock.t) == 0
    assert store.get("t", "resp_0") is not None


def test_default_retention():
    assert DEFAULT_RETENTION_S == 30 * 24 * 3600
    s = ResponseStore()
    assert s.retention_s == DEFAULT_RETENTION_S
    s.close()
    with pytest.raises(ValueError):
        ResponseStore(retention_s=0)


def test_first_put_after_reopen_purges(tmp_path):
    path = tmp_path / "r.db"
    s = ResponseStore(path, retention_s=100)
    s.clock = Clock(T0)
    put(s, "t", "resp_1")
    s.close()
    s = ResponseStore(path, retention_s=100)  # restarted long after: resp_1 has expired
    s.clock = Clock(T0 + 500)
    put(s, "t", "resp_2")
    assert sqlite3.connect(path).execute("SELECT id FROM responses").fetchall() == [("resp_2",)]
    s.close()


def test_concurrent_puts(tmp_path):
    s = ResponseStore(tmp_path / "r.db")
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(w: int) -> None:
        try:
            start.wait()
            for i in range(50):
                rid = f"resp_{w}_{i}"
                put(s, f"tenant{w % 3}", rid, items=[reasoning(f"rs_{w}_{i}")])
                assert s.get(f"tenant{w % 3}", rid) is not None
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for w in range(8):
        for i in range(50):
            assert s.get(f"tenant{w % 3}", f"resp_{w}_{i}") is not None
            assert s.item(f"tenant{w % 3}", f"rs_{w}_{i}")["thinking"] == "secret thoughts"
    assert sqlite3.connect(tmp_path / "r.db").execute("SELECT count(*) FROM responses").fetchone()[0] == 400
    s.close()


def test_newer_schema_version_is_refused(tmp_path):
    path = tmp_path / "r.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE future (x)")
    conn.execute(f"PRAGMA user_version = {responses_store.SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(SchemaVersionError, match="newer"):
        ResponseStore(path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == responses_store.SCHEMA_VERSION + 1
    assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'responses'").fetchone() is None  # untouched
    conn.close()


def test_bad_arguments(store):
    with pytest.raises(ValueError):
        store.put("t", {"object": "response"}, [], [], [])
    with pytest.raises(ValueError):
        store.put("t", response("resp_1"), [{"type": "message"}], [], [])
    with pytest.raises(ValueError):
        store.put("t", response("resp_1"), [], [], [{"type": "reasoning"}])
    with pytest.raises(TypeError):
        store.get(None, "resp_1")
    # a failed put writes nothing
    with pytest.raises(TypeError):
        store.put("t", response("resp_1"), [], [object()], [])
    assert store.get("t", "resp_1") is None
