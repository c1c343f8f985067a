"""What the API adapters share over HTTP: bodies parsed off the event loop, the caller's tenant, response
headers, and watching for a client that goes away while a non-streamed answer is computed.

Nothing heavy runs on the event loop, so `/health` and every stream keep moving while a huge request is
read: a route of class `ParsedBody` reads the raw body and validates it (strict JSON types: `"yes"` is
not a boolean, `"10"` not an integer) on a worker thread, and the adapters render and tokenize there too
(`off_loop`).
"""

from __future__ import annotations

import asyncio
import functools
import typing
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from horizon.serving import ANONYMOUS, ERROR_KINDS, Prepared, ServiceError

# Parsing, validation, rendering and tokenizing of requests. A few threads: they share the GIL with the
# loop and the engine, so more would not go faster; a burst of huge bodies queues here, not on the loop.
_WORKERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="horizon-prepare")


async def off_loop(fn: Callable, *args, **kwargs):
    """Run fn(*args, **kwargs) on a worker thread and await its result (exceptions re-raised here)."""
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(fn, *args, **kwargs))


class ParsedBody(APIRoute):
    """A route whose endpoint is `async def f(body: SomeModel, request: Request)`: the raw body is read and
    validated with strict types on a worker thread, then the endpoint runs. Its OpenAPI schema is FastAPI's,
    from the same signature. Routes of other shapes are FastAPI's own."""

    def get_route_handler(self):
        hints = typing.get_type_hints(self.endpoint)
        model = hints.get("body")
        if not (isinstance(model, type) and issubclass(model, BaseModel) and list(hints)[:2] == ["body", "request"]):
            return super().get_route_handler()
        endpoint = self.endpoint

        async def route(request: Request) -> Response:
            raw = await request.body()
            try:
                body = await off_loop(model.model_validate_json, raw or b"null", strict=True)
            except ValidationError as e:
                raise RequestValidationError(body_errors(e)) from None
            result = await endpoint(body, request)
            return result if isinstance(result, Response) else JSONResponse(jsonable_encoder(result))

        return route


def body_errors(e: ValidationError) -> list[dict]:
    """pydantic's errors as FastAPI reports a body's (loc under "body"), without echoing the input back."""
    out = []
    for err in e.errors(include_url=False, include_input=False):
        err = dict(err)
        if err.get("type") == "json_invalid":
            err["msg"] = f"the body is not valid JSON ({err.get('msg', '').removeprefix('Invalid JSON: ')})"
        elif err.get("type") == "model_type" and not err.get("loc"):
            err["msg"] = "the body must be a JSON object"
        err["loc"] = ("body", *err.get("loc", ()))
        err.pop("ctx", None)
        out.append(err)
    return out


def error_body(anthropic: bool, kind: str, message: str, param: str | None = None,
               code: str | None = None) -> tuple[int, dict]:
    """(status, body) of an error in Anthropic's shape or OpenAI's; also the event that ends a stream whose
    status line was already sent."""
    status, openai_type, anthropic_type = ERROR_KINDS[kind]
    if anthropic:
        return (529 if kind == "overloaded" else status), {"type": "error", "error": {"type": anthropic_type,
                                                                                      "message": message}}
    code = code or {"authentication": "invalid_api_key", "overloaded": "server_busy",
                    "unavailable": "server_shutting_down", "too_large": "request_too_large",
                    "timeout": "request_timeout", "not_found": "not_found"}.get(kind)
    return status, {"error": {"message": message, "type": openai_type, "param": param, "code": code}}


def stream_error(e: ServiceError, anthropic: bool = False) -> dict:
    """The event that ends a stream with an error (the status line is long gone)."""
    return error_body(anthropic, e.kind, e.anthropic_message if anthropic else e.message, e.param, e.code)[1]


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
