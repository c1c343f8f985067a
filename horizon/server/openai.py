"""OpenAI-compatible routes: /v1/models (chat completions are being added)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

router = APIRouter()
STARTED = int(time.time())


@router.get("/v1/models")
async def list_models(request: Request):
    service = request.app.state.service
    return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": STARTED,
                                        "owned_by": "horizon", "max_model_len": service.context_window}]}
