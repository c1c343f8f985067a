"""The web playground: a page at `/` that chats with the served model, shows its thinking live, runs tools on
the server, and exports the conversation as the messages an SDK would send.

Routes (`create_app(..., playground=PlaygroundSettings(...))`; `horizon serve --no-playground` leaves them out):

  GET  /                      the page (plain HTML/JS/CSS from `horizon/server/web/`, nothing from the network)
  GET  /playground/{file}     its script and style sheet
  POST /playground/run        one user turn through the agent loop (`horizon.agent.Agent` over
                              `ServingClient`, the live engine): SSE events `step`, `thinking`, `text`,
                              `tool_call`, `tool_args`, `turn` (usage, time to first token), `tool_result`,
                              `done` (why it stopped), then `history`: the whole conversation exactly as
                              the API returns it (or `error`)

The tools are the built-in `calculator`, the simulated `terminal` (an in-memory file system; nothing on
the host), and `files` only under `--playground-root`; never `shell`.

The server listens where a browser can reach it, so the run endpoint trusts no page but its own: it needs
the per-page CSRF token (an HMAC of a nonce under a key made at start), an `Origin` equal to the server's
own, and a `Host` that is an IP address, `localhost` or an allowed name — a malicious site cannot POST to
127.0.0.1, and DNS rebinding (its own name resolving to 127.0.0.1) is refused on the Host. With API keys
the page asks for one (held in memory only) and sends it as a Bearer token. The page is served with a
Content-Security-Policy of `default-src 'self'` and inserts model output and tool results as text only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import secrets
import threading
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from horizon.agent import Agent, AgentConfig, fixed_policy
from horizon.agent.local import ServingClient
from horizon.agent.registry import make_tools
from horizon.server.http import ParsedBody, error_body

CSP = "default-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
STATIC = {"app.js": "text/javascript", "style.css": "text/css"}
MAX_RUNS = 4  # playground runs at once (each holds a thread while its tools and steps run)


@dataclass
class PlaygroundSettings:
    root: str | None = None  # the folder the `files` tool may use; None: no `files` tool
    allowed_hosts: list[str] = field(default_factory=list)  # host names (besides IPs and localhost) the page may use
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32))  # signs CSRF tokens

    @property
    def toolsets(self) -> list[str]:
        return ["calculator", "terminal"] + (["files"] if self.root else [])

    def csrf_token(self) -> str:
        nonce = secrets.token_hex(16)
        return f"{nonce}.{self._mac(nonce)}"

    def csrf_ok(self, token: str | None) -> bool:
        nonce, _, mac = (token or "").partition(".")
        return bool(nonce) and hmac.compare_digest(mac, self._mac(nonce))

    def _mac(self, nonce: str) -> str:
        return hmac.new(self.key, nonce.encode(), hashlib.sha256).hexdigest()


class RunRequest(BaseModel):
    """One user turn: the history so far (as `done` returned it), the new message, and how to answer it."""

    messages: list[dict[str, Any]] = Field(default_factory=list)
    content: str | list[dict[str, Any]]  # text, or OpenAI content parts (text and image_url)
    system: str | None = None
    tier: Literal["low", "high", "max"] | None = None
    tools: list[Literal["calculator", "terminal", "files"]] = Field(default_factory=list)
    tool_choice: Literal["auto", "required", "none"] = "auto"
    response_schema: dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    max_tokens: int = Field(default=512, ge=1, le=32768)
    max_steps: int = Field(default=6, ge=1, le=32)


def host_allowed(host: str, allowed: list[str]) -> bool:
    """An IP literal (DNS rebinding needs a name), localhost, or a name the server was told to accept."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]").lower()
    if name in ("localhost", *[a.lower() for a in allowed]):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def refusal(request: Request, settings: PlaygroundSettings) -> str | None:
    """Why a run request is not from this server's own page (None: it is)."""
    host = request.headers.get("host", "")
    if not host_allowed(host, settings.allowed_hosts):
        return (f"Host {host!r} is not this server's (an IP address, localhost, or one given with "
                "--playground-allowed-host)")
    origin = request.headers.get("origin")
    if origin != f"{request.url.scheme}://{host}":
        return f"Origin {origin!r} is not this server's own page"
    if not settings.csrf_ok(request.headers.get("x-horizon-csrf")):
        return "missing or invalid CSRF token (reload the page)"
    return None


def create_router(settings: PlaygroundSettings) -> APIRouter:
    router = APIRouter(route_class=ParsedBody)
    web = resources.files("horizon.server") / "web"
    runs = threading.BoundedSemaphore(MAX_RUNS)

    @router.get("/", include_in_schema=False)
    async def page(request: Request):
        html = (web / "index.html").read_text(encoding="utf-8")
        service = request.app.state.service
        html = (html.replace("{{csrf}}", settings.csrf_token()).replace("{{model}}", _attr(service.model_id))
                .replace("{{auth}}", "on" if request.app.state.settings.tenants() else "off")
                .replace("{{tools}}", _attr(",".join(settings.toolsets))))
        return HTMLResponse(html, headers=_page_headers())

    @router.get("/playground/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in STATIC:
            return Response(status_code=404)
        return Response((web / name).read_bytes(), media_type=STATIC[name], headers=_page_headers())

    @router.post("/playground/run", include_in_schema=False)
    async def run(body: RunRequest, request: Request):
        why = refusal(request, settings)
        if why is not None:
            return _error("permission", why)
        if request.app.state.settings.tenants() and not getattr(request.state, "tenant", None):
            return _error("authentication", "this server needs an API key: enter it on the page")
        unknown = [t for t in body.tools if t not in settings.toolsets]
        if unknown:
            return _error("invalid_request", f"tools {unknown} are not offered here (offered: "
                                             f"{', '.join(settings.toolsets)}; files needs the server started "
                                             "with --playground-root)")
        return StreamingResponse(events(body, request.app.state.service, runs), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def events(body: RunRequest, service, runs: threading.BoundedSemaphore):
        """Run the agent on its own thread; its events come here through a queue, as SSE. The run's slot is
        taken here, not in the route: a response whose body never starts (the page left at once) holds none."""
        if not runs.acquire(blocking=False):
            message = f"{MAX_RUNS} playground runs are going already; retry shortly"
            yield f"event: error\ndata: {json.dumps({'message': message})}\n\n"
            return
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        client = ServingClient(service)

        def emit(kind: str, data: dict) -> None:
            loop.call_soon_threadsafe(out.put_nowait, (kind, data))

        def work() -> None:
            try:
                tools = make_tools(body.tools, Path(settings.root) if settings.root else None, seed=0)
                agent = Agent(client, tools, fixed_policy(body.tier, body.tool_choice if body.tools else None),
                              AgentConfig(max_steps=body.max_steps, max_tokens_per_step=body.max_tokens,
                                          system=body.system, temperature=body.temperature,
                                          response_schema=body.response_schema), on_event=emit)
                result = agent.run(body.content, list(body.messages))  # text or content parts (an image)
                emit("history", {"messages": result.messages})  # after the agent's own `done`
            except Exception as e:  # never a traceback: the page shows the error
                emit("error", {"message": f"{type(e).__name__}: {e}"})
            finally:
                runs.release()
                emit("end", {})

        threading.Thread(target=work, name="horizon-playground", daemon=True).start()
        try:
            while True:
                kind, data = await out.get()
                if kind == "end":
                    return
                yield f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
        finally:
            client.cancel()  # the page went away: stop the step in flight

    return router


def _attr(text: str) -> str:
    """Text safe inside a double-quoted HTML attribute."""
    return (text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;").replace(">", "&gt;"))


def _page_headers() -> dict[str, str]:
    return {"content-security-policy": CSP, "x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
            "cache-control": "no-store"}


def _error(kind: str, message: str) -> JSONResponse:
    status, body = error_body(False, kind, message)
    return JSONResponse(body, status_code=status)
