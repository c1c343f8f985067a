"""The Horizon tokenizer: byte-level BPE plus the chat special tokens, and the loader for it.

The bundled vocabulary (``assets/tokenizer.json``, made by ``python -m horizon.chat.train_tokenizer``)
has exactly 4096 ids: the special tokens below at ids 0-31, the 256 single-byte tokens, then BPE
merges. Larger vocabularies may follow the same layout; the wrapper finds the special tokens by
their text, so it does not assume the ids.

Security property: ordinary text never becomes a special token. Two independent reasons:
  * ``encode`` runs with the library's special-token matching switched off
    (``encode_special_tokens = True``), so a user who types ``<｜user｜>`` gets ordinary tokens;
  * every special token's text contains U+FF5C (fullwidth vertical bar), which is not a
    character of the byte-level alphabet, so no BPE merge can ever spell a special token.
Special tokens enter a sequence only through the chat template, by id.

    tok = load_tokenizer()                # bundled; or load_tokenizer("ckpt/") / ("x/tokenizer.json")
    ids = tok.encode("hello")             # ordinary text
    tok.decode(ids) == "hello"
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, fields
from pathlib import Path

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

BUNDLED_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer.json"
TOKENIZER_FILE = "tokenizer.json"  # the name next to model checkpoints

# name -> text, in id order (ids 0, 1, ...). Reserved slots let later issues (vision, agents) add
# tokens without retraining or moving ids.
NUM_RESERVED = 12
SPECIAL_TOKENS: dict[str, str] = {
    "end_of_text": "<｜end_of_text｜>",  # document separator in pre-training; also ends a turn
    "system": "<｜system｜>",
    "system_end": "<｜/system｜>",
    "user": "<｜user｜>",
    "user_end": "<｜/user｜>",
    "assistant": "<｜assistant｜>",
    "assistant_end": "<｜/assistant｜>",
    "tool": "<｜tool｜>",  # a tool result
    "tool_end": "<｜/tool｜>",
    "think": "<｜think｜>",
    "think_end": "<｜/think｜>",
    "tool_call": "<｜tool_call｜>",
    "tool_call_end": "<｜/tool_call｜>",
    "tools": "<｜tools｜>",  # the tool definitions block
    "tools_end": "<｜/tools｜>",
    "image": "<｜image｜>",  # one image placeholder; the vision encoder's outputs replace these
    "tier_off": "<｜tier_off｜>",  # the thinking tier, stated right after <｜assistant｜>
    "tier_low": "<｜tier_low｜>",
    "tier_high": "<｜tier_high｜>",
    "tier_max": "<｜tier_max｜>",
    **{f"reserved_{i}": f"<｜reserved_{i}｜>" for i in range(NUM_RESERVED)},
}


@dataclass(frozen=True)
class SpecialIds:
    """The id of every special token (reserved slots aside), looked up by text in a vocabulary."""

    end_of_text: int
    system: int
    system_end: int
    user: int
    user_end: int
    assistant: int
    assistant_end: int
    tool: int
    tool_end: int
    think: int
    think_end: int
    tool_call: int
    tool_call_end: int
    tools: int
    tools_end: int
    image: int
    tier_off: int
    tier_low: int
    tier_high: int
    tier_max: int

    def tier(self, tier: str | None) -> int:
        """The id stating a thinking tier: None (thinking off), "low", "high" or "max"."""
        return {None: self.tier_off, "low": self.tier_low, "high": self.tier_high, "max": self.tier_max}[tier]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte maps to one printable character.

    Printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards; the `tokenizers`
    ByteLevel pre-tokenizer uses this same table, and the tests check that they agree.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


class HorizonTokenizer:
    """A loaded vocabulary: ordinary-text encode/decode, per-token bytes, and the special ids."""

    def __init__(self, backend: Tokenizer, source: str = "<memory>"):
        # Match special-token text as ordinary text: the one switch that prevents role injection.
        backend.encode_special_tokens = True
        self._backend = backend
        self.source = source
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        special_ids = {tok.content: i for i, tok in added.items() if tok.special}
        missing = [text for text in SPECIAL_TOKENS.values() if text not in special_ids]
        if missing:
            raise ValueError(
                f"tokenizer {source} lacks the Horizon special tokens {missing}; "
                "a Horizon vocabulary must define every token in horizon.chat.tokenizer.SPECIAL_TOKENS"
            )
        self.special = SpecialIds(**{f.name: special_ids[SPECIAL_TOKENS[f.name]] for f in fields(SpecialIds)})
        self.special_ids: frozenset[int] = frozenset(special_ids.values())
        self.special_text = {i: text for text, i in special_ids.items()}
        # id -> the bytes the token stands for; None for special tokens. Streaming decoders need
        # bytes, not text: a token may hold half of a multi-byte character.
        self._bytes: list[bytes | None] = [None] * self.vocab_size
        for text, i in backend.get_vocab(with_added_tokens=False).items():
            if i in self.special_ids:
                continue
            try:
                self._bytes[i] = bytes(_UNICODE_TO_BYTE[c] for c in text)
            except KeyError:
                raise ValueError(
                    f"tokenizer {source}: token {i} {text!r} is not in the byte-level alphabet; "
                    "Horizon needs a byte-level BPE vocabulary"
                ) from None
        holes = [i for i in range(self.vocab_size) if self._bytes[i] is None and i not in self.special_ids]
        if holes:
            raise ValueError(f"tokenizer {source}: ids {holes[:10]} have no token; ids must be contiguous")

    def encode(self, text: str) -> list[int]:
        """Ordinary text to ids. Never produces a special token, whatever the text says."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        try:
            return self._backend.encode(text, add_special_tokens=False).ids
        except TypeError:
            # The backend rejects strings that are not valid Unicode (lone surrogates).
            raise ValueError(
                f"text is not valid Unicode (it contains a lone surrogate): {text[:80]!r}; "
                "only text that can be written as UTF-8 can be tokenized"
            ) from None

    def decode(self, ids: list[int]) -> str:
        """Ids to text; special tokens appear as their text, invalid UTF-8 as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes of an ordinary token; None for a special token. ValueError outside the vocab."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self._bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level characters for ordinary tokens), for debugging."""
        return self._backend.id_to_token(token_id)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json (e.g. next to a checkpoint)."""
        self._backend.save(str(path))

    def to_str(self) -> str:
        return self._backend.to_str()

    def __repr__(self) -> str:
        return f"HorizonTokenizer(vocab_size={self.vocab_size}, source={self.source!r})"


def load_tokenizer(path: str | Path | None = None) -> HorizonTokenizer:
    """Load a Horizon tokenizer.

    ``path`` is a ``tokenizer.json`` file, or a checkpoint folder (its ``tokenizer.json`` is used if
    it has one, otherwise the bundled tokenizer), or None for the bundled tokenizer.
    """
    if path is None:
        return bundled_tokenizer()
    p = Path(path)
    if p.is_dir():
        if not (p / TOKENIZER_FILE).is_file():
            log.info("no %s in %s; using the bundled tokenizer", TOKENIZER_FILE, p)
            return bundled_tokenizer()
        p = p / TOKENIZER_FILE
    elif not p.is_file():
        raise ValueError(
            f"no tokenizer at {str(path)!r}: expected a tokenizer.json file or a checkpoint folder"
        )
    try:
        backend = Tokenizer.from_file(str(p))
    except Exception as e:  # the library raises a bare Exception for unreadable JSON
        raise ValueError(f"cannot read tokenizer {str(p)!r}: {e}") from None
    return HorizonTokenizer(backend, source=str(p))


@functools.cache
def bundled_tokenizer() -> HorizonTokenizer:
    """The tokenizer shipped in the package (loaded once)."""
    if not BUNDLED_TOKENIZER.is_file():
        raise ValueError(
            f"the bundled tokenizer {BUNDLED_TOKENIZER} is missing; "
            "run `python -m horizon.chat.train_tokenizer`"
        )
    return HorizonTokenizer(Tokenizer.from_file(str(BUNDLED_TOKENIZER)), source=str(BUNDLED_TOKENIZER))
