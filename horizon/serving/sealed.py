"""Sealed reasoning: the `encrypted_content` blob that carries a turn's thinking through a stateless client.

A Responses API client that keeps no server-side state (`store: false`, `include: ["reasoning.encrypted_content"]`)
sends the model's reasoning back with every request as an opaque blob. The server seals the thinking (its text, the
exact token ids, the tier) so the client holds the full history but cannot forge or edit it; what matters is
integrity. Confidentiality comes with AES-GCM but is incidental: the thinking is also returned in clear elsewhere.

Blob, URL-safe base64 without padding:

    version (1 byte, = 1) || key id (4) || tier length (1) || tier (UTF-8) || nonce (12) || AES-256-GCM ciphertext+tag

The tier is in the clear header because `open` must say which tier the thinking was made under without the caller
knowing it; the header is part of the associated data, so it cannot be changed either. The associated data also
binds the context (tenant, model, tier, conversation item id, as a JSON list, so no two contexts encode alike): a blob
opens only for the tenant, model and item it was sealed for, and cannot be moved to another tenant or item.

Nonces are fresh random bytes on every seal, never a counter: restarts and replicas share the key file, so no
process could know which counter values another has used, and a repeated GCM nonce under one key gives away the key's
authentication secret. Random 96-bit nonces are safe for about 2**32 seals per key; rotate well before that.

Keys live in a file (created on first use, mode 0600), one per line, newest first: `<key id: 8 hex> <key: 64 hex>`.
New blobs use the first key; every listed key still opens the blobs it made, so a key is rotated by prepending a new
line and keeping the old ones until the conversations sealed under them no longer matter. The file is read once,
when a `ReasoningSeal` is made.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
import time
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

VERSION = 1
MAX_PLAINTEXT_BYTES = 1 << 20
# Base64 of a blob at MAX_PLAINTEXT_BYTES is about 1.4 MiB; anything far past that was not made here, and is refused
# before decoding it costs anything.
MAX_BLOB_CHARS = 2 << 20
KEY_FILE_NAME = "reasoning-seal.keys"

_KEY_ID_BYTES = 4
_NONCE_BYTES = 12
_TAG_BYTES = 16
_MAX_TIER_BYTES = 255  # its length is one byte in the header
_DOMAIN = "horizon-reasoning-seal-v1"  # keeps this associated data distinct from any other use of these keys
_KEY_LINE = re.compile(r"([0-9a-fA-F]{8})\s+([0-9a-fA-F]{64})")
_URLSAFE_B64 = re.compile(r"[A-Za-z0-9_-]*={0,2}")


class SealError(ValueError):
    """A blob that does not open: tampered, foreign, truncated, too large, or for another context."""


def default_key_file() -> Path:
    # The same directory as horizon.server.signatures.default_key_file(), written out here rather than imported:
    # horizon.serving knows nothing of horizon.server (importing it would bring in FastAPI). A test checks they agree.
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "horizon" / KEY_FILE_NAME


class ReasoningSeal:
    def __init__(self, key_file: str | os.PathLike | None = None):
        self.key_file = Path(key_file) if key_file is not None else default_key_file()
        keys = _load_or_create(self.key_file)
        self._current_id = keys[0][0]
        self._ciphers = {key_id: AESGCM(key) for key_id, key in keys}

    @property
    def key_id(self) -> str:
        """The id (8 hex characters) of the key new blobs are sealed under."""
        return self._current_id.hex()

    def seal(self, payload: dict, *, tenant: str, model: str, tier: str, item_id: str) -> str:
        if not isinstance(payload, dict):
            raise TypeError(f"the sealed payload must be a dict, not {type(payload).__name__}")
        _check_context(tenant=tenant, model=model, tier=tier, item_id=item_id)
        tier_bytes = tier.encode("utf-8")
        if len(tier_bytes) > _MAX_TIER_BYTES:
            raise ValueError(f"a sealed tier name is at most {_MAX_TIER_BYTES} bytes of UTF-8")
        plaintext = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
        if len(plaintext) > MAX_PLAINTEXT_BYTES:
            raise ValueError(f"the sealed payload is {len(plaintext)} bytes of JSON; at most {MAX_PLAINTEXT_BYTES}")
        header = bytes([VERSION]) + self._current_id + bytes([len(tier_bytes)]) + tier_bytes
        nonce = os.urandom(_NONCE_BYTES)
        associated = _associated(header, tenant, model, tier, item_id)
        sealed = self._ciphers[self._current_id].encrypt(nonce, plaintext, associated)
        return base64.urlsafe_b64encode(header + nonce + sealed).rstrip(b"=").decode("ascii")

    def open(self, blob: str, *, tenant: str, model: str, item_id: str) -> tuple[str, dict]:
        _check_context(tenant=tenant, model=model, item_id=item_id)
        if not isinstance(blob, str):
            raise SealError("the sealed reasoning is not a string")
        if len(blob) > MAX_BLOB_CHARS:
            raise SealError(f"the sealed reasoning is over {MAX_BLOB_CHARS} characters")
        data = _unbase64(blob)
        if not data:
            raise SealError("the sealed reasoning is empty")
        if data[0] != VERSION:
            raise SealError(f"the sealed reasoning has an unknown version ({data[0]})")
        pos = 1 + _KEY_ID_BYTES + 1
        if len(data) < pos:
            raise SealError("the sealed reasoning is truncated")
        key_id = data[1:1 + _KEY_ID_BYTES]
        tier_end = pos + data[pos - 1]
        if len(data) < tier_end + _NONCE_BYTES + _TAG_BYTES:
            raise SealError("the sealed reasoning is truncated")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            # The id is not secret, and naming it tells an operator which key file is missing a line.
            raise SealError(f"the reasoning was sealed under a key this server does not have (key id {key_id.hex()})")
        header = data[:tier_end]
        try:
            tier = header[pos:].decode("utf-8")
        except UnicodeDecodeError:
            raise SealError("the sealed reasoning does not authenticate") from None
        nonce = data[tier_end:tier_end + _NONCE_BYTES]
        try:
            plaintext = cipher.decrypt(nonce, data[tier_end + _NONCE_BYTES:],
                                       _associated(header, tenant, model, tier, item_id))
        except InvalidTag:
            raise SealError("the sealed reasoning does not authenticate: altered, or sealed for another tenant, "
                            "model or item") from None
        try:
            payload = json.loads(plaintext.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise SealError("the sealed reasoning is not JSON") from None
        if not isinstance(payload, dict):
            raise SealError("the sealed reasoning is not a JSON object")
        return tier, payload


def _check_context(**fields: object) -> None:
    for name, value in fields.items():
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, not {type(value).__name__}")


def _associated(header: bytes, tenant: str, model: str, tier: str, item_id: str) -> bytes:
    # The header is self-delimiting (its tier is length-prefixed) and the JSON list quotes every field, so distinct
    # (header, context) pairs never give the same bytes.
    return header + json.dumps([_DOMAIN, tenant, model, tier, item_id]).encode("ascii")


def _unbase64(blob: str) -> bytes:
    # Checked here because the decoders skip stray characters, and with altchars still take '+' and '/'.
    if not _URLSAFE_B64.fullmatch(blob):
        raise SealError("the sealed reasoning is not URL-safe base64")
    raw = blob.rstrip("=").encode("ascii")
    if len(raw) % 4 == 1:  # no byte string encodes to this length: something was cut off
        raise SealError("the sealed reasoning is truncated")
    try:
        return base64.urlsafe_b64decode(raw + b"=" * (-len(raw) % 4))
    except binascii.Error:
        raise SealError("the sealed reasoning is not URL-safe base64") from None


def _load_or_create(path: Path) -> list[tuple[bytes, bytes]]:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        key_id, key = secrets.token_bytes(_KEY_ID_BYTES), AESGCM.generate_key(bit_length=256)
        text = ("# Horizon reasoning seal keys, newest first: <key id> <key>. New blobs use the first; every key\n"
                "# listed opens the blobs made with it. Rotate by adding a new line at the top.\n"
                f"{key_id.hex()} {key.hex()}\n")
        try:
            # O_EXCL: of processes starting at once, one creates the file and the rest read it, so none replaces a
            # key that another has already sealed blobs under.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            try:
                os.fchmod(fd, 0o600)  # whatever the umask
                os.write(fd, text.encode("ascii"))
                os.fsync(fd)
            finally:
                os.close(fd)
            return [(key_id, key)]
    return _read_keys(path)


def _read_keys(path: Path) -> list[tuple[bytes, bytes]]:
    # A process that lost the creation race can find the file before the winner has written its line; give the
    # winner a moment rather than failing on an empty file.
    text = path.read_text(encoding="utf-8")
    for _ in range(50):
        if text:
            break
        time.sleep(0.02)
        text = path.read_text(encoding="utf-8")
    keys: list[tuple[bytes, bytes]] = []
    seen: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _KEY_LINE.fullmatch(line)
        if match is None:
            raise ValueError(f"{path}, line {number}: expected '<key id: 8 hex characters> <key: 64 hex characters>'")
        key_id = bytes.fromhex(match[1])
        if key_id in seen:
            # Two keys under one id would open some blobs and not others, depending on which one won.
            raise ValueError(f"{path}, line {number}: key id {match[1]} is already used on line {seen[key_id]}")
        seen[key_id] = number
        keys.append((key_id, bytes.fromhex(match[2])))
    if not keys:
        raise ValueError(f"{path}: the reasoning seal key file holds no keys")
    return keys
