"""What both API adapters share over HTTP: the caller's tenant, response headers, and watching for a client
that goes away while a non-streamed answer is computed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import Request

from horizon.serving import ANONYMOUS, Prepared


def request_tenant(request: Request) -> str:
    """The tenant the API key named (set by the app's auth middleware); one anonymous tenant without keys."""
    return getattr(request.state, "tenant", None) or ANONYMOUS


def warning_header(warnings: list[str]) -> dict[str, str]:
    if not warnings:
        return {}
    text = " ".join("; ".join(warnings).split()).encode("ascii", "backslashreplace").decode()  # one latin-1 line
    return {"x-horizon-warning": text[:4000]}


def response_headers(prepared: Prepared) -> dict[str, str]:
    """Warnings (served anyway), and how many assistant turns had their thinking restored by the server."""
    headers = warning_header(prepared.warnings)
    if prepared.restored:
        headers["x-horizon-restored"] = str(prepared.restored)
    return headers


async def run_until_done(request: Request, work: Awaitable, cancel: Callable[[], None]) -> bool:
    """Await `work` (True), or stop at once when the client disconnects first (False); `cancel` runs either
    way, so the engine frees what the request held."""

    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            return False
        task.result()  # re-raise what went wrong in it, if anything
        return True
    finally:
        for t in (task, watch):
            t.cancel()
        cancel()
