"""Sealed reasoning blobs (horizon.serving.sealed): round trips, key files, rotation, and what must not open."""

from __future__ import annotations

import base64
import json
import os
import stat
import threading

import pytest

from horizon.serving.sealed import MAX_PLAINTEXT_BYTES, ReasoningSeal, SealError, default_key_file

CONTEXT = {"tenant": "acme", "model": "horizon-tiny", "item_id": "rs_0001"}
PAYLOAD = {"thinking": "First, add the numbers. ✓", "token_ids": [5, 17, 0, 65535], "tier": "high"}
OLD_LINE = "0a0b0c0d " + "11" * 32
NEW_LINE = "deadbeef " + "22" * 32


def unb64(blob: str) -> bytes:
    return base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4))


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


@pytest.fixture
def seal(tmp_path) -> ReasoningSeal:
    return ReasoningSeal(tmp_path / "keys")


def test_round_trip_returns_tier_and_payload(seal):
    blob = seal.seal(PAYLOAD, tier="high", **CONTEXT)
    assert isinstance(blob, str) and "=" not in blob
    assert set(blob) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert seal.open(blob, **CONTEXT) == ("high", PAYLOAD)
    assert "First" not in unb64(blob).decode("latin-1")  # the thinking is not in the blob in clear


def test_blob_layout(seal):
    data = unb64(seal.seal(PAYLOAD, tier="high", **CONTEXT))
    assert data[0] == 1
    assert data[1:5].hex() == seal.key_id
    assert data[5] == 4 and data[6:10] == b"high"
    plaintext = json.dumps(PAYLOAD, separators=(",", ":"), ensure_ascii=False).encode()
    assert len(data) == 10 + 12 + len(plaintext) + 16


def test_fresh_nonce_each_seal(seal):
    a = seal.seal(PAYLOAD, tier="high", **CONTEXT)
    b = seal.seal(PAYLOAD, tier="high", **CONTEXT)
    assert a != b
    assert unb64(a)[10:22] != unb64(b)[10:22]
    assert seal.open(a, **CONTEXT) == seal.open(b, **CONTEXT) == ("high", PAYLOAD)


def test_key_file_created_0600_and_reused_across_restart(tmp_path):
    path = tmp_path / "state" / "horizon" / "reasoning-seal.keys"  # parent directories do not exist yet
    first = ReasoningSeal(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    content = path.read_text()
    blob = first.seal(PAYLOAD, tier="low", **CONTEXT)
    second = ReasoningSeal(path)
    assert path.read_text() == content  # read, not replaced
    assert second.key_id == first.key_id
    assert second.open(blob, **CONTEXT) == ("low", PAYLOAD)


def test_separate_key_files_have_separate_keys(tmp_path):
    a, b = ReasoningSeal(tmp_path / "a"), ReasoningSeal(tmp_path / "b")
    assert a.key_id != b.key_id
    with pytest.raises(SealError, match="key"):
        b.open(a.seal(PAYLOAD, tier="high", **CONTEXT), **CONTEXT)


def test_rotation_opens_old_blobs_and_seals_with_new_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# old key only\n{OLD_LINE}\n")
    old = ReasoningSeal(path)
    old_blob = old.seal(PAYLOAD, tier="high", **CONTEXT)
    assert unb64(old_blob)[1:5].hex() == "0a0b0c0d"

    path.write_text(f"{NEW_LINE}\n\n# kept so that blobs sealed under it still open\n{OLD_LINE}\n")
    rotated = ReasoningSeal(path)
    assert rotated.key_id == "deadbeef"
    assert rotated.open(old_blob, **CONTEXT) == ("high", PAYLOAD)
    new_blob = rotated.seal(PAYLOAD, tier="medium", **CONTEXT)
    assert unb64(new_blob)[1:5].hex() == "deadbeef"
    assert rotated.open(new_blob, **CONTEXT) == ("medium", PAYLOAD)
    with pytest.raises(SealError, match="key"):
        old.open(new_blob, **CONTEXT)  # a server that does not have the new key yet


# Header: 0 version, 1-4 key id, 5 tier length, 6-9 tier; 10-21 nonce; then ciphertext; the last 16 bytes the tag.
@pytest.mark.parametrize("position", [0, 2, 5, 7, 10, 21, 22, 30, -17, -16, -1])
def test_flipped_byte_does_not_open(seal, position):
    data = bytearray(unb64(seal.seal(PAYLOAD, tier="high", **CONTEXT)))
    data[position] ^= 0x01
    with pytest.raises(SealError):
        seal.open(b64(bytes(data)), **CONTEXT)


def test_tier_cannot_be_rewritten(seal):
    data = bytearray(unb64(seal.seal(PAYLOAD, tier="low", **CONTEXT)))
    assert data[6:9] == b"low"
    data[6:9] = b"max"  # same length, a valid tier name: only the associated data stops it
    with pytest.raises(SealError, match="authenticate"):
        seal.open(b64(bytes(data)), **CONTEXT)


@pytest.mark.parametrize("field", ["tenant", "model", "item_id"])
def test_other_context_does_not_open(seal, field):
    blob = seal.seal(PAYLOAD, tier="high", **CONTEXT)
    with pytest.raises(SealError, match="authenticate"):
        seal.open(blob, **{**CONTEXT, field: CONTEXT[field] + "x"})


def test_context_fields_are_not_confusable(seal):
    # Moving a character between adjacent fields must not give the same associated data.
    blob = seal.seal(PAYLOAD, tenant="ab", model="c", tier="high", item_id="d")
    with pytest.raises(SealError):
        seal.open(blob, tenant="a", model="bc", item_id="d")


def test_unknown_key_id(seal):
    data = bytearray(unb64(seal.seal(PAYLOAD, tier="high", **CONTEXT)))
    data[1:5] = bytes.fromhex("00000000") if seal.key_id != "00000000" else bytes.fromhex("ffffffff")
    with pytest.raises(SealError, match="key this server does not have"):
        seal.open(b64(bytes(data)), **CONTEXT)


def test_unknown_version(seal):
    data = bytearray(unb64(seal.seal(PAYLOAD, tier="high", **CONTEXT)))
    data[0] = 2
    with pytest.raises(SealError, match="version"):
        seal.open(b64(bytes(data)), **CONTEXT)


@pytest.mark.parametrize("blob", ["", "not base64!", "a+b/", "ab\ncd", "éé", "A", "=" * 8,
                                  b64(b"\x01"), b64(b"\x01abcd")])
def test_garbage_does_not_open(seal, blob):
    with pytest.raises(SealError):
        seal.open(blob, **CONTEXT)


@pytest.mark.parametrize("keep", [1, 5, 9, 21, 37, -1])
def test_truncated_does_not_open(seal, keep):
    blob = seal.seal(PAYLOAD, tier="high", **CONTEXT)
    data = unb64(blob)
    with pytest.raises(SealError):
        seal.open(b64(data[:keep]), **CONTEXT)
    with pytest.raises(SealError):
        seal.open(blob[:-1], **CONTEXT)  # cut mid-character


def test_oversized_blob_refused(seal):
    with pytest.raises(SealError, match="over"):
        seal.open("A" * (2 * 1024 * 1024 + 4), **CONTEXT)


def test_payload_size_limit(seal):
    fits = {"t": "x" * (MAX_PLAINTEXT_BYTES - len('{"t":""}'))}
    assert seal.open(seal.seal(fits, tier="high", **CONTEXT), **CONTEXT) == ("high", fits)
    with pytest.raises(ValueError, match="bytes"):
        seal.seal({"t": fits["t"] + "x"}, tier="high", **CONTEXT)


def test_payload_must_be_a_json_object(seal):
    with pytest.raises(TypeError):
        seal.seal(["not", "a", "dict"], tier="high", **CONTEXT)
    with pytest.raises(ValueError):
        seal.seal({"x": float("nan")}, tier="high", **CONTEXT)


@pytest.mark.parametrize("bad", ["0a0b0c0d", "0a0b0c0 " + "11" * 32, "0a0b0c0d " + "11" * 31,
                                 "0a0b0c0d " + "zz" * 32, "0a0b0c0d " + "11" * 32 + " extra"])
def test_malformed_key_file_names_the_line(tmp_path, bad):
    path = tmp_path / "keys"
    path.write_text(f"# comment\n{NEW_LINE}\n\n{bad}\n")
    with pytest.raises(ValueError, match=r"keys, line 4\b") as caught:
        ReasoningSeal(path)
    assert not isinstance(caught.value, SealError)
    assert str(path) in str(caught.value)


def test_duplicate_key_id_refused(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{OLD_LINE}\n{OLD_LINE[:9]}{'33' * 32}\n")
    with pytest.raises(ValueError, match="line 2"):
        ReasoningSeal(path)


def test_key_file_without_keys_refused(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# nothing here\n\n")
    with pytest.raises(ValueError, match="no keys"):
        ReasoningSeal(path)


def test_default_key_file_beside_thinking_signature_key(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    from horizon.server.signatures import default_key_file as signature_key_file

    assert default_key_file() == signature_key_file().parent / "reasoning-seal.keys"
    seal = ReasoningSeal()
    assert seal.key_file == tmp_path / "horizon" / "reasoning-seal.keys"
    assert seal.key_file.exists()


def test_racing_creators_agree_on_one_key(tmp_path):
    path, barrier, ids = tmp_path / "keys", threading.Barrier(8), []

    def start():
        barrier.wait()
        ids.append(ReasoningSeal(path).key_id)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ids) == 8 and len(set(ids)) == 1
    assert ReasoningSeal(path).key_id == ids[0]
