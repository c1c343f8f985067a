"""Thinking signatures: an HMAC of a thinking block's text under a key kept in a file.

Anthropic-style clients send thinking blocks back with the `signature` the server gave them; a
block whose signature does not verify was edited (or made elsewhere) and is refused under the
history policy. The key lives in a file (created on first use, mode 0600) so signatures verify
across restarts and across replicas that share the file.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

DOMAIN = b"horizon-thinking-v1\x00"  # keeps these MACs distinct from any other use of the key


def default_key_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "horizon" / "thinking-signature.key"


class ThinkingSigner:
    def __init__(self, key_file: str | Path | None = None):
        self.key_file = Path(key_file) if key_file else default_key_file()
        self.key = self._load_or_create()

    def _load_or_create(self) -> bytes:
        path = self.key_file
        if path.exists():
            text = path.read_text().strip()
            try:
                key = bytes.fromhex(text)
            except ValueError:
                raise ValueError(f"{path}: the signature key file must hold a hex key") from None
            if len(key) < 16:
                raise ValueError(f"{path}: the signature key is {len(key)} bytes; at least 16 are needed")
            return key
        path.parent.mkdir(parents=True, exist_ok=True)
        key = secrets.token_bytes(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
        return key

    def sign(self, thinking: str) -> str:
        mac = hmac.new(self.key, DOMAIN + thinking.encode("utf-8"), hashlib.sha256).digest()
        return base64.b64encode(mac).decode("ascii")

    def verify(self, thinking: str, signature: str | None) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(self.sign(thinking), signature)
