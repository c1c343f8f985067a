"""Anthropic-compatible routes (being added)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
