"""The HTTP server: one FastAPI app over one engine, with the OpenAI and Anthropic adapters mounted.

What is shared by both APIs lives here: request ids, the body-size limit, API keys (each key a
tenant: stored thinking is kept per tenant), errors in each API's own shape (never a traceback),
unknown routes named with the supported ones, health, Prometheus metrics, tokenize, and the
engine's lifetime (started with the app, stopped after the last request drains on shutdown).

Errors: routes under /v1/messages answer in Anthropic's shape
`{"type": "error", "error": {"type", "message"}}` (overload: 529); everything else in OpenAI's
`{"error": {"message", "type", "param", "code"}}` (overload: 429).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from horizon.server.http import ParsedBody, error_body, off_loop
from horizon.server.metrics import ServerMetrics
from horizon.server.playground import PlaygroundSettings
from horizon.server.signatures import ThinkingSigner, default_key_file
from horizon.serving import RETRY_AFTER_S, Conversation, ModelService, ServiceError, Tool
from horizon.serving.responses_store import ResponseStore
from horizon.serving.sealed import ReasoningSeal

log = logging.getLogger("horizon.server")


@dataclass
class ServerSettings:
    api_key: str | None = None  # one key (a tenant of its own); with api_keys, one more
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant name; none at all: no authentication
    max_body_bytes: int = 16 * 1024 * 1024
    body_timeout_s: float = 30  # a body that stalls this long gets a 408
    signature_key_file: str | None = None  # None: horizon.server.signatures.default_key_file()
    responses_db: str | None = None  # the Responses API's store; None: responses.sqlite3 in the state directory
    responses_retention_days: float = 30
    reasoning_key_file: str | None = None  # keys sealing encrypted reasoning; None: beside the signature key

    def tenants(self) -> dict[str, str]:
        keys = dict(self.api_keys)
        if self.api_key:
            keys.setdefault(self.api_key, tenant_of_key(self.api_key))
        return keys


def tenant_of_key(key: str) -> str:
    """A key's tenant when none is named: a digest, so logs and metrics never show the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def read_keys_file(path: str) -> dict[str, str]:
    """API keys, one per line: `KEY` or `TENANT:KEY` (blank lines and `#` comments skipped)."""
    keys: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            tenant, sep, key = line.rpartition(":")
            key, tenant = key.strip(), tenant.strip() if sep else tenant_of_key(key.strip())
            if not key or not tenant:
                raise ValueError(f"{path}:{n}: expected KEY or TENANT:KEY")
            if key in keys:
                raise ValueError(f"{path}:{n}: this key is listed twice")
            keys[key] = tenant
    return keys


ROUTES = ("POST /v1/chat/completions", "POST /v1/responses", "GET|DELETE /v1/responses/{id}",
          "GET /v1/responses/{id}/input_items", "GET /v1/models", "POST /v1/messages", "POST /v1/messages/count_tokens",
          "POST /tokenize", "GET /health", "GET /metrics", "GET / (the playground)")


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, kind: str, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None, code: str | None = None) -> JSONResponse:
    """An error in the shape of the API the path belongs to."""
    status, body = error_body(is_anthropic(path), kind, message, param, code)
    if kind in ("overloaded", "unavailable"):  # a retry may work: say when (the SDKs honour it)
        headers = {"retry-after": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(body, status_code=status, headers=headers)


class BodyGuard:
    """ASGI middleware: refuse bodies over the limit, whether or not Content-Length is declared, and answer 408
    when a body stops arriving for `timeout_s` (a stalled client must not hold a worker's request open)."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_large = error_response(scope["path"], "too_large",
                                   f"the request body exceeds the limit of {self.max_bytes} bytes")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_large(scope, receive, send)
        seen, answered, body_done = 0, False, False

        async def refuse(response) -> dict:
            nonlocal answered
            if not answered:  # answer now; the app then sees a client that went away
                answered = True
                await response(scope, receive, send)
            return {"type": "http.disconnect"}

        async def guarded_receive():
            nonlocal seen, body_done
            if body_done:  # after the body, receive() waits for a disconnect: no deadline on that
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                return await refuse(error_response(scope["path"], "timeout", f"the request body stalled: nothing "
                                                   f"arrived for {self.timeout_s:g} s"))
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max_bytes:
                    return await refuse(too_large)
            return message

        async def guarded_send(message):
            if not answered:
                await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if not answered:
                raise


class TokenizeRequest(BaseModel):
    text: str | None = None
    prompt: str | None = None  # vLLM's name for text
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    tier: str | None = None
    add_generation_prompt: bool = True


def create_app(service: ModelService, settings: ServerSettings | None = None,
               playground: PlaygroundSettings | None = None) -> FastAPI:
    """The app; `playground` adds the web page at `/` and its run endpoint (horizon.server.playground)."""
    settings = settings or ServerSettings()
    engine = service.engine
    keys = settings.tenants()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="Horizon", version="0.1.0", lifespan=lifespan,
                  description="OpenAI- and Anthropic-compatible serving of Horizon models")
    app.state.service = service
    app.state.settings = settings
    app.state.metrics = metrics = ServerMetrics(engine, service.turns)
    app.state.signer = ThinkingSigner(settings.signature_key_file)
    app.state.reasoning_seal = ReasoningSeal(settings.reasoning_key_file)
    app.state.responses_store = ResponseStore(settings.responses_db or str(default_key_file().parent /
                                                                           "responses.sqlite3"),
                                              retention_s=settings.responses_retention_days * 86400)

    @app.middleware("http")
    async def request_ids_auth_and_counts(request: Request, call_next):
        request_id = "req_" + secrets.token_hex(12)
        request.state.request_id = request_id
        path = request.url.path
        response = _check_api_key(request, keys)
        if response is None:
            try:
                response = await call_next(request)
            except Exception:  # anything a handler did not turn into an API error
                log.exception("unhandled error in %s %s (%s)", request.method, path, request_id)
                response = error_response(path, "internal", f"internal error (request id {request_id})")
        response.headers["x-request-id"] = request_id  # OpenAI's header
        response.headers["request-id"] = request_id  # Anthropic's header
        route = request.scope.get("route")
        metrics.requests.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        return response

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError):
        path = request.url.path
        message = exc.anthropic_message if is_anthropic(path) else exc.message
        return error_response(path, exc.kind, message, exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error_response(request.url.path, "invalid_request", _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = {401: "authentication", 404: "not_found", 413: "too_large"}.get(exc.status_code, "invalid_request")
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (f"{request.method} {request.url.path} is not a route of this server; it serves "
                       f"{', '.join(ROUTES)} (see /docs)")
        if exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(request.url.path, kind, message)

    @app.get("/health")
    async def health():
        m = engine.metrics()
        return {"status": "ok", "model": service.model_id, "running": m["running"], "queue": m["queue_length"]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.router.route_class = ParsedBody  # the routes below parse their body off the event loop

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        """Token ids of plain text, or of a chat as the server would render it."""
        return await off_loop(tokenized, body)

    def tokenized(body: TokenizeRequest) -> dict:
        text = body.text if body.text is not None else body.prompt
        if sum(x is not None for x in (body.text, body.prompt, body.messages)) != 1:
            raise ServiceError("invalid_request", "send exactly one of 'text' (or 'prompt') or 'messages'")
        if text is not None:
            try:
                ids = service.tokenizer.encode(text)
            except ValueError as e:
                raise ServiceError("invalid_request", str(e), param="text") from None
        else:
            try:
                tools = [Tool.from_openai(t) for t in body.tools or ()]
            except (KeyError, TypeError, AttributeError):
                raise ServiceError("invalid_request", "tools: each needs a function with a name",
                                   param="tools") from None
            conv = Conversation(body.messages, tools, body.tier)
            ids, _ = service.render(conv, add_generation_prompt=body.add_generation_prompt,
                                    pixels=service.decode_images(conv))
        return {"model": service.model_id, "tokens": ids, "count": len(ids),
                "max_model_len": service.context_window}

    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)

    from horizon.server import anthropic, openai, responses

    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(anthropic.router)
    if playground is not None:
        from horizon.server.playground import create_router

        app.include_router(create_router(playground))
    return app


def _check_api_key(request: Request, keys: dict[str, str]) -> Response | None:
    """None when allowed (the key's tenant set on the request); else a 401 in the route's shape. Every key
    is compared, in constant time, so the answer's timing says nothing about which came close."""
    if not keys or not (request.url.path.startswith("/v1/") or request.url.path == "/playground/run"):
        return None
    path = request.url.path
    auth = request.headers.get("authorization", "")
    bearer = auth[7:] if auth[:7].lower() == "bearer " else ""
    # Anthropic's API takes x-api-key; its current SDK may send a Bearer token instead: accept either
    given = ((request.headers.get("x-api-key") or bearer) if is_anthropic(path) else bearer).encode()
    tenant = None
    for key, name in keys.items():
        if hmac.compare_digest(given, key.encode()) and given:
            tenant = name
    if tenant is not None:
        request.state.tenant = tenant
        return None
    where = "x-api-key header" if is_anthropic(path) else "Authorization: Bearer header"
    return error_response(path, "authentication", f"missing or invalid API key (send it in the {where})")


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)
