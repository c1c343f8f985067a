"""Fixtures for the chat-layer tests: the bundled tokenizer and a template over it."""

from __future__ import annotations

import pytest

from horizon.chat import ChatTemplate, HorizonTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tok() -> HorizonTokenizer:
    return load_tokenizer()


@pytest.fixture(scope="session")
def template(tok) -> ChatTemplate:
    return ChatTemplate(tok)
