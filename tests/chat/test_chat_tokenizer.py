"""The tokenizer: exact vocabulary layout, byte-exact round trips, no special tokens from text, loading."""

from __future__ import annotations

import json
import shutil

import pytest
from chat_strategies import TRICKY, any_char, chat_settings, text
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from horizon.chat import BUNDLED_TOKENIZER, SPECIAL_TOKENS, load_tokenizer
from horizon.chat.tokenizer import HorizonTokenizer, bytes_to_unicode
from horizon.chat.train_tokenizer import main as train_main


def test_vocabulary_has_exactly_4096_ids_with_the_specials_first(tok):
    assert tok.vocab_size == 4096
    assert json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8"))["model"]["type"] == "BPE"
    for i, text_ in enumerate(SPECIAL_TOKENS.values()):
        assert tok.id_to_token(i) == text_ and tok.is_special(i)
    assert tok.special_ids == frozenset(range(len(SPECIAL_TOKENS)))
    # Every single byte has its own token, so any text encodes without an unknown token.
    assert {tok.token_bytes(i) for i in range(tok.vocab_size) if len(tok.token_bytes(i) or b"") == 1} == {
        bytes([b]) for b in range(256)
    }


def test_byte_table_agrees_with_the_library(tok):
    assert set(bytes_to_unicode().values()) == set(pre_tokenizers.ByteLevel.alphabet())
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        expected = (
            SPECIAL_TOKENS[list(SPECIAL_TOKENS)[i]] if b is None else b.decode("utf-8", errors="replace")
        )
        assert tok.decode([i]) == expected, i


@chat_settings
@given(st.text(any_char, max_size=200))
def test_decode_encode_round_trips_any_unicode(tok, s):
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    assert b"".join(tok.token_bytes(i) for i in ids) == s.encode("utf-8")
    assert all(0 <= i < 4096 and not tok.is_special(i) for i in ids)


@chat_settings
@given(st.lists(st.sampled_from(TRICKY) | text, max_size=8).map("".join))
def test_text_never_encodes_to_a_special_token(tok, s):
    ids = tok.encode(s)
    assert not any(tok.is_special(i) for i in ids)
    assert tok.decode(ids) == s


def test_literal_special_token_text_is_ordinary_text(tok):
    for text_ in SPECIAL_TOKENS.values():
        ids = tok.encode(f"x{text_}y")
        assert not set(ids) & tok.special_ids
        assert tok.decode(ids) == f"x{text_}y"
    # The switch matters: the same vocabulary with special parsing on would produce the role token.
    raw = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    raw.encode_special_tokens = False
    assert tok.special.user in raw.encode("<｜user｜>", add_special_tokens=False).ids
    # And no merge spells a special token: none of their texts is an ordinary vocabulary entry.
    entries = {tok.id_to_token(i) for i in range(tok.vocab_size) if not tok.is_special(i)}
    assert not entries & set(SPECIAL_TOKENS.values())


def test_invalid_input_is_a_value_error(tok):
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("a\ud800b")
    with pytest.raises(ValueError, match="takes a str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(4096)


def test_loader_reads_a_file_a_checkpoint_folder_or_falls_back(tmp_path):
    bundled = load_tokenizer()
    assert load_tokenizer(BUNDLED_TOKENIZER).encode("hello") == bundled.encode("hello")
    assert load_tokenizer(tmp_path) is bundled  # a checkpoint folder without tokenizer.json
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(BUNDLED_TOKENIZER, ckpt / "tokenizer.json")
    from_folder = load_tokenizer(ckpt)
    assert from_folder is not bundled and from_folder.source == str(ckpt / "tokenizer.json")
    assert from_folder.special == bundled.special
    with pytest.raises(ValueError, match="no tokenizer at"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path / "broken.json")


def test_a_vocabulary_without_the_special_tokens_is_rejected():
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<｜user｜>"],
        show_progress=False,
    )
    backend.train_from_iterator(["some text"], trainer)
    with pytest.raises(ValueError, match="lacks the Horizon special tokens"):
        HorizonTokenizer(backend)


def test_bundled_tokenizer_is_what_the_training_script_makes(capsys):
    assert train_main(["--check"]) == 0, capsys.readouterr().out
