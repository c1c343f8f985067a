"""Reading JSONL files (one JSON value per line), for training data and evaluation task sets alike.

A neutral room: `horizon.train` and `horizon.eval` both read JSONL, and neither may import the other
for it (evaluation runs inside training; a shared reader in either would make a cycle).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def jsonl_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line of a JSONL file; ValueError naming the line
    for one that is not JSON."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except ValueError as e:  # json.JSONDecodeError is a ValueError
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None
