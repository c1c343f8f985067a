"""A live uvicorn server on a free port, for tests that drive the HTTP APIs with the real SDKs."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

from horizon.checkpoint import open_model
from horizon.engine import Engine, EngineConfig, Request, SamplingParams
from horizon.server import ServerSettings, create_app
from horizon.server.background import BackgroundServer
from horizon.serving import ModelService


class LiveServer(BackgroundServer):
    """`with LiveServer(tmp_path, api_key="k") as srv: srv.url ...`; srv.engine / srv.service / srv.app.

    `api_keys` (key -> tenant) adds keys of named tenants.
    `generation_config` entries override the bundled model's (e.g. `{"thinking_budgets": {"low": 4}}`:
    small tier budgets keep thinking requests short on the random model, which never stops thinking).
    """

    def __init__(self, key_dir, api_key: str | None = "test-key", history_policy: str = "reject",
                 max_queue: int = 64, engine_config: EngineConfig | None = None, max_body_bytes: int = 1 << 20,
                 generation_config: dict | None = None, api_keys: dict[str, str] | None = None,
                 header_timeout_s: float = 10, body_timeout_s: float = 30, playground=None,
                 model: str = "tiny-random"):
        bundle = open_model(model)
        self.engine = Engine(bundle.model, bundle.tokenizer,
                             engine_config or EngineConfig(max_num_seqs=4, max_model_len=2048, max_batch_tokens=256),
                             generation_config={**bundle.generation_config, **(generation_config or {})})
        self.service = ModelService(self.engine, bundle.tokenizer, "horizon-test", history_policy=history_policy,
                                    max_queue=max_queue)
        self.app = create_app(self.service, ServerSettings(api_key=api_key, api_keys=api_keys or {},
                                                           max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                                                           signature_key_file=str(key_dir / "signature.key"),
                                                           reasoning_key_file=str(key_dir / "reasoning.keys"),
                                                           responses_db=str(key_dir / "responses.sqlite3")),
                              playground)
        self.api_key = api_key
        super().__init__(self.app, header_timeout_s=header_timeout_s)


@contextmanager
def engine_requests(server: LiveServer, change: Callable | None = None):
    """The requests the engine gets below the serving seam, in order (a list, filled as they come); `change`
    may replace each one first (steer the random model the way a trained one would choose)."""
    seen, submit = [], server.engine.submit

    def hook(request, on_event, max_queued=None):
        request = change(request) if change else request
        seen.append(request)
        return submit(request, on_event, max_queued)

    server.engine.submit = hook  # every way in (streams, the playground's client) goes through submit
    try:
        yield seen
    finally:
        del server.engine.submit


@contextmanager
def busy_server(key_dir):
    """A LiveServer whose one slot is taken (by a long request made below the seam) and whose queue holds
    nothing: every request it gets is refused as overloaded."""
    with LiveServer(key_dir, max_queue=0,
                    engine_config=EngineConfig(max_num_seqs=1, max_model_len=2048, max_batch_tokens=256)) as srv:
        hog = Request([1, 2, 3], SamplingParams(max_tokens=2000, ignore_eos=True))
        srv.engine.submit(hog, lambda event: None)
        try:
            yield srv
        finally:
            srv.engine.cancel(hog.request_id)
