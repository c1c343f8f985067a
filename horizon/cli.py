"""The `horizon` command line.

    horizon plan --preset k3 [--context N] [--tp N] [--json]   parameters, memory and GPUs (per rank)
    horizon inspect DIR [--json]                             check a checkpoint from its headers; counts and plan
    horizon export --format kimi-k3 MODEL OUT                 a model in Kimi K3's released layout
    horizon quantize SRC DST                                 store a checkpoint's routed experts as MXFP4
    horizon convert SRC DST [--quantize mxfp4] [--to-dsa]   a Kimi-Linear / DeepSeek-V3.2 folder -> Horizon
    horizon generate [--model PATH] --prompt TEXT [--tier low|high|max]   one answer, streamed
    horizon chat [--model PATH] [--tier ...]                 an interactive conversation (full history kept)
    horizon serve [--model PATH] [--host H] [--port P] ...   the OpenAI/Anthropic-compatible server

--model defaults to the bundled model, horizon-tiny (the `mini` preset trained here on CPU, MXFP4
experts); `--model tiny-random` is the random-weight model the tests use.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from horizon.config import ModelConfig
from horizon.presets import PRESETS


def _cmd_plan(args: argparse.Namespace) -> int:
    from horizon.plan import GPU_BYTES, parallel_plan, parse_bytes, plan, render_parallel, render_plan

    if args.config:
        config, name = ModelConfig.load(args.config), args.config
    else:
        config, name = ModelConfig.preset(args.preset), args.preset
    result = plan(config, context=args.context)
    per_rank = None
    if args.tp is not None or args.enable_expert_parallel or args.gpu_memory is not None:
        tp = 1 if args.tp is None else args.tp
        if args.enable_expert_parallel and tp == 1:
            raise ValueError("--enable-expert-parallel needs --tp > 1 (the ranks hold the experts)")
        gpu = parse_bytes(args.gpu_memory) if args.gpu_memory is not None else GPU_BYTES
        per_rank = parallel_plan(config, tp, args.enable_expert_parallel, args.context, gpu)
        result["parallel"] = per_rank
    if args.json:
        print(json.dumps(result))
        return 0
    render_plan(name, result)
    if per_rank is not None:
        render_parallel(name, per_rank)
    return 0


def _progress(description: str, total: int):
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    progress = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                        TimeRemainingColumn())
    task = progress.add_task(description, total=total)
    return progress, lambda n: progress.advance(task, n)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from horizon.checkpoint import TensorStore, quantize_checkpoint

    store = TensorStore(args.src)
    progress, advance = _progress("quantizing", sum(store.nbytes(n) for n in store.names()))
    with progress:
        quantize_checkpoint(args.src, args.dst, method=args.method, progress=advance)
    print(f"wrote {args.dst} (routed experts in {args.method})")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    import torch

    from horizon.checkpoint import TOKENIZER, load, save

    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = load(args.src, dtype=dtype)
    if args.to_dsa:
        from horizon.interop.convert import to_dsa

        sizes = {k: v for k, v in (("index_topk", args.index_topk), ("index_n_heads", args.index_heads),
                                   ("index_head_dim", args.index_head_dim)) if v is not None}
        model = to_dsa(model, **sizes)
    dst = Path(args.dst)
    dst.mkdir(parents=True, exist_ok=True)
    if (Path(args.src) / TOKENIZER).exists():  # keep the model's own tokenizer
        shutil.copyfile(Path(args.src) / TOKENIZER, dst / TOKENIZER)
    save(model, dst, quantize=args.quantize)
    print(f"wrote {dst} ({model.num_parameters():,} parameters"
          f"{', routed experts in ' + args.quantize if args.quantize else ''})")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    import torch

    from horizon.checkpoint import TOKENIZER, load
    from horizon.interop import kimi_k3

    model = load(args.model)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    tokenizer = Path(args.model) / TOKENIZER  # the model's own tokenizer travels with it
    kimi_k3.export(model, args.out, dtype=dtype)
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, Path(args.out) / TOKENIZER)
    print(f"wrote {args.out} in Kimi K3's layout ({model.num_parameters():,} parameters; "
          f"routed experts as compressed-tensors MXFP4)")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from horizon.inspect import inspect_checkpoint, render_inspection

    report = inspect_checkpoint(args.folder)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render_inspection(report)
    return 0


class TerminalStream:
    """Prints a turn's deltas as they arrive: thinking dimmed, tool calls in brackets, the answer plain."""

    def __init__(self):
        from rich.console import Console

        self.console = Console(highlight=False, soft_wrap=True)
        self.mode = None

    def __call__(self, event) -> None:
        from horizon.chat import ErrorDelta, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
        from horizon.engine import FinishEvent

        for d in event.deltas:
            if isinstance(d, ReasoningDelta):
                self._switch("think", "[dim]thinking: [/dim]")
                self.console.print(d.text, style="dim", end="")
            elif isinstance(d, TextDelta):
                self._switch("text", "")
                self.console.print(d.text, end="", markup=False)
            elif isinstance(d, ToolCallStart):
                self._switch("tool", "")
                self.console.print(f"[cyan][tool call {d.name}(", end="", markup=False)
            elif isinstance(d, ToolCallArgs):
                self.console.print(d.text, style="cyan", end="", markup=False)
            elif isinstance(d, ToolCallEnd):
                self.console.print(")]", style="cyan", end="", markup=False)
            elif isinstance(d, ErrorDelta):
                self.console.print(f"[parser: {d.code}: {d.message}]", style="red", end="", markup=False)
        if isinstance(event, FinishEvent):
            u = event.usage
            self.console.print()
            error = f" {event.error}" if event.error else ""
            self.console.print(f"[{event.reason}; {u.completion_tokens} tokens, {u.reasoning_tokens} thinking, "
                               f"{u.cached_tokens} prompt tokens from cache]{error}", style="dim", markup=False)
            self.mode = None

    def _switch(self, mode: str, header: str) -> None:
        if self.mode != mode:
            if self.mode is not None:
                self.console.print()
            if header:
                self.console.print(header, end="")
            self.mode = mode


def _open_engine(args, layout=None):
    from horizon.checkpoint import open_model
    from horizon.engine import Engine, EngineConfig

    bundle = open_model(args.model, **_formats(args), layout=layout)
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(max_num_seqs=1, max_batch_tokens=512),
                    generation_config=bundle.generation_config)
    return bundle, engine


def _lockstep(engine, layout, drive) -> int:
    """Run `drive` (which uses `engine` on the calling thread) on rank 0 of a tensor-parallel group while the
    other ranks follow its steps, then stop them all; in one process (layout None) just run it."""
    from horizon.parallel.group import leave_group

    if layout is not None and layout.rank != 0:
        engine.follow()
        leave_group()
        return 0
    try:
        code = drive()
    finally:
        if layout is not None:
            engine.stop()  # the other ranks' follow() returns
    if layout is not None:
        leave_group()
    return code


def _formats(args) -> dict[str, str | None]:
    """--dense-weights {full,int8} and --mxfp4-activations {fp32,int8} -> open_model's `dense` and
    `mxfp4_activations` (None: as stored, fp32)."""
    return {"dense": None if args.dense_weights == "full" else args.dense_weights,
            "mxfp4_activations": None if args.mxfp4_activations == "fp32" else args.mxfp4_activations}


def _params(args):
    from horizon.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed, tier=args.tier)


def _cmd_generate(args: argparse.Namespace) -> int:
    from horizon.chat import ChatTemplate
    from horizon.engine import Request

    layout = _parallel(args)
    if isinstance(layout, int):  # this process launched the ranks; they have ended
        return layout
    bundle, engine = _open_engine(args, layout)

    def drive() -> int:
        messages = [{"role": "user", "content": args.prompt}]
        prompt = ChatTemplate(bundle.tokenizer).render(messages, tier=args.tier, add_generation_prompt=True).ids
        engine.submit(Request(prompt, _params(args)), TerminalStream())
        engine.run_until_idle()
        return 0

    return _lockstep(engine, layout, drive)


def _cmd_chat(args: argparse.Namespace) -> int:
    from horizon.chat import ChatTemplate, StreamParser
    from horizon.engine import FinishEvent, Request

    bundle, engine = _open_engine(args)
    template = ChatTemplate(bundle.tokenizer)
    show = TerminalStream()
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print(f"horizon chat with {bundle.source} (tier {args.tier or 'off'}); an empty line or Ctrl-D ends it")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if not line:
            return 0
        messages.append({"role": "user", "content": line})
        prompt = template.render(messages, tier=args.tier, add_generation_prompt=True).ids
        parser = StreamParser(bundle.tokenizer, tier=args.tier)

        def on_event(event, parser=parser):
            show(event)
            if isinstance(event, FinishEvent):
                parser.finish()
            else:
                parser.feed(event.token_id)

        engine.submit(Request(prompt, _params(args)), on_event)
        engine.run_until_idle()
        # the reply goes back exactly as generated (thinking included): the next turn resumes from cache
        messages.append(parser.result().to_message())


def _build_app(model: str | None, served_model_name: str | None = None, api_keys: dict[str, str] | None = None,
               history_policy: str = "reject", signature_key_file: str | None = None, max_num_seqs: int = 16,
               max_model_len: int | None = None, max_batch_tokens: int = 512, coverage_every: int = 64,
               max_queue: int = 64, max_body_bytes: int = 16 * 1024 * 1024, local_images: str | None = None,
               thinking_store_mb: float = 64, responses_db: str | None = None,
               responses_retention_days: float = 30, reasoning_key_file: str | None = None,
               prefix_snapshot_turns: int = 2, body_timeout_s: float = 30, prefix_cache_mb: float = 256,
               check_weights: bool = True, playground: bool = True, playground_root: str | None = None,
               playground_hosts: list[str] | None = None, compile: bool = False,
               formats: dict[str, str | None] | None = None, layout=None):
    """(the FastAPI app over one engine, the served model id, the checkpoint's source)."""
    import os

    from horizon.server import ModelService, ServerSettings, create_app
    from horizon.server.playground import PlaygroundSettings

    bundle, engine = _serve_engine(model, check_weights, formats or {}, layout, max_num_seqs=max_num_seqs,
                                   max_model_len=max_model_len, max_batch_tokens=max_batch_tokens,
                                   coverage_every=coverage_every, prefix_cache_bytes=int(prefix_cache_mb * 1024**2),
                                   compile=compile, compile_in_background=compile)
    shipped = {"bundled:horizon-tiny": "horizon-tiny", "bundled:tiny-random": "horizon-tiny-random"}
    model_id = served_model_name or shipped.get(bundle.source) or os.path.basename(os.path.abspath(model))
    from horizon.chat.images import ImageLimits

    limits = ImageLimits(allow_local_files=True, local_root=local_images) if local_images else ImageLimits()
    service = ModelService(engine, bundle.tokenizer, model_id, history_policy=history_policy, max_queue=max_queue,
                           image_limits=limits, turn_store_bytes=int(thinking_store_mb * 1024**2),
                           prefix_snapshot_turns=prefix_snapshot_turns)
    app = create_app(service, ServerSettings(api_keys=api_keys or {}, max_body_bytes=max_body_bytes,
                                             responses_db=responses_db, reasoning_key_file=reasoning_key_file,
                                             responses_retention_days=responses_retention_days,
                                             signature_key_file=signature_key_file, body_timeout_s=body_timeout_s),
                     PlaygroundSettings(playground_root, playground_hosts or []) if playground else None)
    return app, model_id, bundle.source


def _serve_engine(model: str | None, check_weights: bool, formats: dict[str, str | None], layout, **engine_config):
    """(the model bundle, the engine over it): the part of the server every tensor-parallel rank builds."""
    from horizon.checkpoint import open_model
    from horizon.engine import Engine, EngineConfig

    bundle = open_model(model, check_finite=check_weights, layout=layout, **formats)
    return bundle, Engine(bundle.model, bundle.tokenizer, EngineConfig(**engine_config),
                          generation_config=bundle.generation_config)


def _parallel(args: argparse.Namespace):
    """Where this process stands under --tensor-parallel-size N: None (one process), an int (this process
    launched the N ranks, and this is their exit status), or this rank's Layout (under torchrun or the
    launcher). The model's sizes are checked against N before any rank starts or any weight is read."""
    import os

    from horizon.checkpoint import open_config
    from horizon.parallel.group import env_world_size, init_group
    from horizon.parallel.shard import Layout

    n, ep = args.tensor_parallel_size, args.enable_expert_parallel
    if n < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {n}")
    if "WORLD_SIZE" not in os.environ:
        if n == 1:
            if ep:
                raise ValueError("--enable-expert-parallel needs --tensor-parallel-size > 1 "
                                 "(the ranks hold the experts)")
            return None
        config, quantization = open_config(args.model)
        Layout(n, 0, ep).check(config, mxfp4_experts=quantization == "mxfp4")
        from horizon.parallel.launch import launch

        return launch(args.argv, n, args.command)
    world = env_world_size()
    if world != n:
        raise ValueError(f"WORLD_SIZE={world} (torchrun's nnodes x nproc-per-node) but --tensor-parallel-size {n}: "
                         "they must be equal")
    if n == 1:
        return None
    group = init_group()
    return Layout(n, group.rank, ep)


def _api_keys(args: argparse.Namespace) -> dict[str, str]:
    """key -> tenant from --api-key (each its own tenant), --api-keys-file and $HORIZON_API_KEY."""
    import os

    from horizon.server import read_keys_file
    from horizon.server.app import tenant_of_key

    keys = {k: tenant_of_key(k) for k in args.api_key or [os.environ.get("HORIZON_API_KEY") or ""] if k}
    if args.api_keys_file:
        try:
            keys.update(read_keys_file(args.api_keys_file))
        except (OSError, ValueError) as e:
            raise SystemExit(f"horizon serve: --api-keys-file: {e}") from None
    return keys


def _cmd_serve(args: argparse.Namespace) -> int:
    from horizon.parallel.group import leave_group
    from horizon.server.process import log_like_uvicorn, serve

    layout = _parallel(args)
    if isinstance(layout, int):  # this process launched the ranks; they have ended
        return layout
    log_like_uvicorn(args.log_level)
    if layout is not None and layout.rank != 0:  # a rank that computes: no HTTP, rank 0's steps
        _, engine = _serve_engine(args.model, not args.no_weight_check, _formats(args), layout,
                                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                  max_batch_tokens=args.max_batch_tokens, coverage_every=args.coverage_every,
                                  prefix_cache_bytes=int(args.prefix_cache_mb * 1024**2),
                                  compile=not args.enforce_eager)
        engine.follow()
        leave_group()
        return 0
    keys = _api_keys(args)
    try:
        app, model_id, source = _build_app(args.model, args.served_model_name, keys, args.history_policy,
                                           args.signature_key_file, args.max_num_seqs, args.max_model_len,
                                           args.max_batch_tokens, args.coverage_every, args.max_queue,
                                           args.max_body_bytes, args.allow_local_images, args.thinking_store_mb,
                                           args.responses_db, args.responses_retention_days, args.reasoning_key_file,
                                           args.prefix_snapshot_turns, args.body_timeout, args.prefix_cache_mb,
                                           not args.no_weight_check, not args.no_playground, args.playground_root,
                                           args.playground_allowed_host, compile=not args.enforce_eager,
                                           formats=_formats(args), layout=layout)
    except ValueError as e:  # a setting the model or engine cannot take (e.g. --max-model-len past the window)
        raise SystemExit(f"horizon serve: {e}") from None
    page = "" if args.no_playground else f"; the playground: http://{args.host}:{args.port}/"
    if layout is not None:
        page += f"; {layout.tp} tensor-parallel ranks{' (experts whole per rank)' if layout.ep else ''}"
    print(f"horizon serve: {model_id} ({source}) on http://{args.host}:{args.port} "
          f"(OpenAI /v1/chat/completions, Anthropic /v1/messages{page}; "
          f"auth {f'on, {len(set(keys.values()))} tenant(s)' if keys else 'off'})", flush=True)
    serve(app, app.state.service, args.host, args.port, args.log_level, drain_timeout_s=args.drain_timeout,
          header_timeout_s=args.header_timeout)
    if layout is not None:  # the drain stopped the engine and the other ranks (again here, if it never started)
        app.state.service.engine.stop()
        leave_group()
    _exit_past_a_compile()
    return 0


def _exit_past_a_compile() -> None:
    """After the drain: a decode graph still compiling in the background (horizon.engine.runner) would hold the
    exit until it is done, up to a minute on 2 cores; nothing is left to serve, so the process exits now (0)."""
    import logging
    import os

    from horizon.engine.runner import compiling_in_background

    if compiling_in_background():
        logging.getLogger("horizon.server").info("exiting without the decode graph still compiling (inductor's "
                                                 "cache keeps what is done for the next start)")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _cmd_agent(args: argparse.Namespace) -> int:
    import contextlib
    import os

    from horizon.agent import Agent, AgentConfig, ClientError, HTTPClient, Transcript, fixed_policy, replay
    from horizon.agent.display import AgentPrinter
    from horizon.agent.registry import make_tools

    names = [n.strip() for n in args.tools.split(",") if n.strip()] if args.tools else []
    tools = make_tools(names, args.root)
    printer = AgentPrinter()
    transcript = Transcript(args.transcript) if args.transcript else None
    if args.replay:
        result = replay(args.replay, tools=tools if args.rerun_tools else None, on_event=printer,
                        transcript=transcript)
        return 1 if result.stop_reason == "error" else 0
    if not args.task:
        raise ValueError("give a task (or --replay TRANSCRIPT)")
    if args.api == "anthropic" and args.tier and args.force_tool:
        raise ValueError("the Anthropic API refuses a forced tool choice with thinking on: drop --tier or "
                         "--force-tool, or use --api openai")
    api_key = args.api_key or os.environ.get("HORIZON_API_KEY") or None
    with contextlib.ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:  # our own server on a free local port, over the same HTTP as any endpoint
            import tempfile

            from horizon.server.background import BackgroundServer

            # thinking signatures only need to verify within this run: a throwaway key
            keys = stack.enter_context(tempfile.TemporaryDirectory(prefix="horizon-agent-"))
            app, model_id, source = _build_app(args.model, api_keys={api_key: "agent"} if api_key else None,
                                               max_num_seqs=4, signature_key_file=os.path.join(keys, "signature.key"),
                                               responses_db=":memory:",
                                               reasoning_key_file=os.path.join(keys, "reasoning.keys"))
            server = stack.enter_context(BackgroundServer(app))
            base_url = server.url
            printer.note(f"{model_id} ({source}) served in-process on {base_url}")
        try:
            client = HTTPClient(base_url, api=args.api, model=args.served_model, api_key=api_key,
                                stream=not args.no_stream)
        except ClientError as e:
            printer.note(f"horizon agent: cannot use {base_url}: {e}")
            return 1
        stack.callback(client.close)
        config = AgentConfig(max_steps=args.max_steps, max_total_tokens=args.max_total_tokens,
                             max_tokens_per_step=args.max_tokens_per_step, system=args.system,
                             temperature=args.temperature, seed=args.seed)
        agent = Agent(client, tools, fixed_policy(args.tier, args.force_tool), config, printer, transcript)
        result = agent.run(args.task)
    if transcript:
        transcript.close()
        printer.note(f"transcript: {args.transcript}")
    return 1 if result.stop_reason == "error" else 0


def _data_parallel(run, args: argparse.Namespace) -> int:
    """train and rl: `run(args, sharded)` in one process, or under torchrun with FSDP over a gloo group that
    is left to whoever started it (a caller that already joined one keeps it). A run every rank finished
    leaves the group together (leave_group: a rank that closes first makes a peer abort at exit); a failed one
    closes it at once (its peers fail on their collective timeout)."""
    import torch.distributed as dist

    from horizon.parallel.group import destroy_group, env_world_size, init_group, leave_group

    if env_world_size() == 1:
        return run(args, sharded=False)
    owned = not dist.is_initialized()
    init_group("cpu")
    try:
        code = run(args, sharded=True)
    except BaseException:
        if owned:
            destroy_group()
        raise
    if owned:
        leave_group()
    return code


def _train_tiers(spec: str) -> list[str]:
    """`horizon train --tier`: one tier or a comma-separated list, each of low, high, max."""
    tiers = [t.strip() for t in spec.split(",")]
    bad = [t for t in tiers if t not in ("low", "high", "max")]
    if bad:
        raise ValueError(f"--tier {spec!r}: {bad} not allowed; give low, high or max, or a comma-separated list "
                         f"of them (e.g. low,high,max)")
    return tiers


def _cmd_train(args: argparse.Namespace) -> int:
    return _data_parallel(_train, args)


def _train(args: argparse.Namespace, sharded: bool) -> int:
    import random
    from pathlib import Path

    tiers = _train_tiers(args.tier)  # a bad tier is refused before any weights load
    if not 0.0 <= args.brief <= 1.0:
        raise ValueError(f"--brief is a share of the references, between 0 and 1; got {args.brief}")

    import torch

    from horizon.chat import load_tokenizer
    from horizon.checkpoint import load, load_generation_config, open_model
    from horizon.model import HorizonForCausalLM
    from horizon.tasks import get_domain, make_split
    from horizon.train import Mixture, TrainConfig, Trainer, read_jsonl, task_example
    from horizon.train.trainer import config_from_dict

    out = Path(args.out)
    resume = out / "checkpoint" / "trainer_state" / "state.json"
    sources_spec = {"domains": args.domains, "ratios": args.ratios, "per_domain": args.per_domain,
                    "data": args.data, "tier": args.tier, "seed": args.seed, "brief": args.brief}
    if args.resume:
        if not resume.exists():
            raise ValueError(f"--resume: {resume} does not exist (nothing to resume in {out})")
        meta = json.loads(resume.read_text())
        saved = meta.get("sources")
        if saved is not None:
            saved = {"brief": 0.0, **saved}  # runs from before --brief trained on full thoughts only
        if saved and args.domains is None and args.data is None:  # no data options: the run's own
            sources_spec = saved
            for key, value in saved.items():
                setattr(args, key, value)
        if saved not in (None, sources_spec):
            raise ValueError(f"--resume: the data options differ from the run being resumed: {meta['sources']}")
        config = config_from_dict({**meta["config"], **({"steps": args.steps} if args.steps else {})})
        model = load(out / "checkpoint", dtype=torch.float32)
        tokenizer = load_tokenizer(out / "checkpoint")
        generation_config = load_generation_config(out / "checkpoint")
    else:
        config = TrainConfig(steps=args.steps or 200, batch_size=args.batch_size, max_len=args.max_len, lr=args.lr,
                             warmup_steps=args.warmup, bf16=args.bf16, seed=args.seed, save_every=args.save_every,
                             log_every=args.log_every, stage=args.stage, **_validation(args))
        tokenizer = load_tokenizer()
        if args.init:  # a checkpoint folder, or "bundled" (the shipped horizon-tiny)
            bundle = open_model(args.init, dtype=torch.float32)
            model, tokenizer, generation_config = bundle.model, bundle.tokenizer, bundle.generation_config
        else:
            torch.manual_seed(args.seed)
            model, generation_config = HorizonForCausalLM(ModelConfig.preset(args.preset).replace(
                dtype="float32")), None
    sources = {}
    names = [d for d in (args.domains or "").split(",") if d]
    for name in names:
        domain = get_domain(name)
        tasks = make_split(domain, "train", args.per_domain, start_seed=args.seed * 1_000_003)
        if args.brief:  # which references go brief: a fixed draw per task, so a resumed run sees the same data
            tasks = [(domain.brief(t) or t) if random.Random(f"brief:{t.id}").random() < args.brief else t
                     for t in tasks]
        sources[name] = [task_example(tokenizer, model.config, t, tiers[k % len(tiers)]) for k, t in enumerate(tasks)]
    if args.data:
        sources["data"] = read_jsonl(args.data, tokenizer, model.config)
    if not sources:
        raise ValueError("nothing to train on: give --domains and/or --data")
    ratios = None
    if args.ratios:
        values = [float(r) for r in args.ratios.split(",")]
        if len(values) != len(sources):
            raise ValueError(f"--ratios has {len(values)} values for {len(sources)} sources {list(sources)}")
        ratios = dict(zip(sources, values, strict=True))
    if args.thinking_budgets:
        from horizon.checkpoint import default_generation_config

        values = [int(v) for v in args.thinking_budgets.split(",")]
        if len(values) != 3 or any(v < 1 for v in values):
            raise ValueError(f"--thinking-budgets takes three positive integers LOW,HIGH,MAX, "
                             f"got {args.thinking_budgets!r}")
        generation_config = {**(generation_config or default_generation_config()),
                             "thinking_budgets": dict(zip(("low", "high", "max"), values, strict=True))}
    if sharded:  # every rank built the same full model; now each keeps its shard of it
        from horizon.parallel.fsdp import shard_for_training

        model = shard_for_training(model)
    trainer = Trainer(model, tokenizer, Mixture(sources, ratios, seed=args.seed), config, out, generation_config)
    trainer.sources_spec = sources_spec
    if args.resume:
        trainer.restore()
    ranks = f" on {trainer.world} ranks (FSDP)" if sharded else ""
    if trainer.writer:
        print(f"horizon train: {model.num_parameters():,} parameters{ranks}; sources "
              f"{ {k: len(v) for k, v in sources.items()} }; step {trainer.step_idx} -> {config.steps}", flush=True)
    log = trainer.train(progress=not args.no_progress, max_minutes=args.max_minutes)
    last = log[-1] if log else {}
    if trainer.writer:
        print(f"done: step {trainer.step_idx}, loss {last.get('loss', float('nan')):.4f}; checkpoint "
              f"{trainer.checkpoint_dir}, log {out / 'train_log.jsonl'}, plot {out / 'train_curves.png'}")
    return 0


def _cmd_rl(args: argparse.Namespace) -> int:
    from horizon.parallel.group import env_world_size

    if env_world_size() > 1 and not args.no_indexer_loss:  # before the group forms or any weight loads
        raise ValueError(f"WORLD_SIZE={env_world_size()}: horizon rl under torchrun (FSDP) needs --no-indexer-loss: "
                         f"the DSA indexer loss recomputes attention outside the layers' forward, where FSDP holds "
                         f"only shards of their weights (or run in one process)")
    return _data_parallel(_rl, args)


def _rl(args: argparse.Namespace, sharded: bool) -> int:
    """horizon rl; sharded: under torchrun, FSDP over the ranks, each rolling out its share of the groups on
    an unsharded copy of the weights (horizon.train.rl)."""
    from pathlib import Path

    import torch

    from horizon.checkpoint import open_model
    from horizon.engine import Engine, EngineConfig
    from horizon.parallel import fsdp
    from horizon.train.rl import RLConfig, RLTrainer
    from horizon.train.trainer import TRAINER_STATE, TrainConfig, config_from_dict

    out = Path(args.out)
    state = out / "checkpoint" / TRAINER_STATE / "state.json"
    source = out / "checkpoint" if args.resume else Path(args.init)
    if args.resume and not state.exists():
        raise ValueError(f"--resume: {state} does not exist (nothing to resume in {out})")
    bundle = open_model(source, dtype=torch.float32)  # "bundled": the shipped horizon-tiny
    model, tokenizer, generation_config = bundle.model, bundle.tokenizer, bundle.generation_config
    tiers = [None if t == "none" else t for t in args.tiers.split(",")]
    rl = RLConfig(domains=args.domains.split(","), ratios=[float(r) for r in args.ratios.split(",")]
                  if args.ratios else None, adaptive=args.adaptive, prompts_per_step=args.prompts,
                  group_size=args.group, tiers=tiers, thinking_cost=args.thinking_cost, kl_coef=args.kl,
                  temperature=args.temperature, max_episode_steps=args.episode_steps, max_tokens=args.max_tokens,
                  indexer_loss=not args.no_indexer_loss, group_std=args.group_std, clip=args.clip,
                  micro_batch=args.micro_batch, train_flat=args.train_flat, guide=args.guide,
                  tier_per_group=args.tier_per_group)
    if args.resume:  # the run's own settings; only --steps moves
        meta = json.loads(state.read_text())
        config = config_from_dict({**meta["config"], **({"steps": args.steps} if args.steps else {})})
        rl = RLConfig(**(meta.get("extra") or {}).get("rl", asdict(rl)))
    else:
        config = TrainConfig(steps=args.steps or 100, lr=args.lr, warmup_steps=args.warmup, seed=args.seed,
                             save_every=args.save_every, log_every=args.log_every, max_len=args.max_len,
                             weight_decay=0.0, **_validation(args))
    rollout_model = model
    if sharded:  # every rank loaded the same model; it keeps its shard and rolls out on a plain copy
        model = fsdp.shard_for_training(model)
        rollout_model = fsdp.gathered_model(model, everywhere=True)
    # sized from the run's own settings (a resume's come from its state, not from the command line)
    # each rank's engine decodes its own groups alone (lockstep=False): data-parallel rollouts
    engine = Engine(rollout_model, tokenizer, EngineConfig(max_num_seqs=min(64, rl.prompts_per_step * rl.group_size),
                                                           max_batch_tokens=4096, lockstep=False),
                    generation_config=generation_config)
    init = args.init if args.init == "bundled" else str(Path(args.init).resolve())  # a resume: the state's
    trainer = RLTrainer(model, tokenizer, engine, config, rl, out, generation_config, init=init)
    if args.resume:
        trainer.restore()
    if trainer.writer:
        # the run's settings as fixed at its start (the thinking cost among them), beside its log; a resume
        # rewrites the same values, since it takes them from the run's state
        out.mkdir(parents=True, exist_ok=True)
        (out / "rl_config.json").write_text(json.dumps({"init": trainer.init, "rl": asdict(rl),
                                                        "thinking_budgets": engine.budgets,
                                                        "train": asdict(config)}, indent=2) + "\n")
        ranks = f" on {trainer.world} ranks (FSDP)" if sharded else ""
        print(f"horizon rl: {','.join(rl.domains)}, {rl.prompts_per_step} tasks x {rl.group_size} rollouts per step"
              f"{ranks}, step {trainer.step_idx} -> {config.steps}", flush=True)
    trainer.train(progress=not args.no_progress, max_minutes=args.max_minutes)
    if trainer.writer:
        print(f"done: checkpoint {trainer.checkpoint_dir}, log {out / 'rl_log.jsonl'}, plot {out / 'rl_curves.png'}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from horizon.checkpoint import open_model
    from horizon.eval import eval_engine

    _eval_tiers(args)  # refused before any weights load
    layout = _parallel(args)
    if isinstance(layout, int):  # this process launched the ranks; they have ended
        return layout
    bundle = open_model(args.model, dtype=getattr(torch, args.dtype) if args.dtype else None, layout=layout)
    engine = eval_engine(bundle.model, bundle.tokenizer, args.batch, args.selection, bundle.generation_config)
    return _lockstep(engine, layout, lambda: _report_eval(args, bundle, engine))


def _eval_tiers(args: argparse.Namespace) -> list[str]:
    """`horizon eval`'s tiers: --tiers (a comma-separated list) or the one --tier."""
    if args.tiers and args.tier:
        raise ValueError(f"give --tier {args.tier} or --tiers {args.tiers}, not both")
    tiers = [t.strip() for t in args.tiers.split(",")] if args.tiers else [args.tier or "low"]
    bad = [t for t in tiers if t not in ("none", "low", "high", "max")]
    if bad or len(set(tiers)) != len(tiers):
        raise ValueError(f"--tiers {args.tiers!r}: give distinct tiers from none, low, high, max, comma-separated "
                         f"(e.g. low,high,max)")
    return tiers


def _report_eval(args: argparse.Namespace, bundle, engine) -> int:
    from horizon.eval import evaluate, tier_order

    domains = [d for d in args.domains.split(",") if d]
    tiers = _eval_tiers(args)
    done = set()

    def progress(name, finished, total):
        if not args.json and finished == total and name not in done:
            done.add(name)
            print(f"{name}: {total} tasks done", file=sys.stderr, flush=True)

    records: list | None = [] if args.records or len(tiers) > 1 else None  # several tiers: paired from them
    by_tier = {}
    for tier in tiers:
        done.clear()
        by_tier[tier] = evaluate(engine, bundle.tokenizer, domains, args.n, None if tier == "none" else tier,
                                 args.max_steps, args.max_tokens, args.seed, progress, records)
    if args.records and records is not None:
        with open(args.records, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    report = {"model": bundle.source, "n": args.n, "selection": args.selection,
              "dtype": str(next(bundle.model.parameters()).dtype).removeprefix("torch."),
              "thinking_budgets": dict(engine.budgets)}
    if len(tiers) == 1:
        report.update({"tier": tiers[0], "domains": by_tier[tiers[0]]})
    else:  # per tier, and each tier against the first on the same tasks
        report.update({"tiers": by_tier, "tier_order": tier_order(records, base=tiers[0])})
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"horizon eval: {bundle.source} ({report['dtype']}), tier {', '.join(tiers)}, {args.n} held-out tasks per "
          f"domain, DSA selection {args.selection}")
    vs = f"vs {tiers[0]} (paired)" if len(tiers) > 1 else ""
    print(f"{'domain':<14} {'tier':<5} {'accuracy':>9} {'95% CI':>15} {'tool-call validity':>19} "
          f"{'thinking tokens':>16}  {vs}")
    for name in domains:
        for tier in tiers:
            r = by_tier[tier][name]
            validity = "-" if r["tool_call_validity"] is None else f"{r['tool_call_validity']:.3f} ({r['tool_calls']})"
            lo, hi = r["ci95"]
            line = (f"{name:<14} {tier:<5} {r['accuracy']:>9.3f} {f'[{lo:.3f}, {hi:.3f}]':>15} {validity:>19} "
                    f"{r['thinking_tokens']:>16.1f}")
            order = report.get("tier_order", {}).get(name, {}).get(tier, {})
            if "vs_" + tiers[0] in order:
                d, (dlo, dhi) = order["vs_" + tiers[0]], order["vs_" + tiers[0] + "_ci95"]
                line += f"  {d:+.3f} [{dlo:+.3f}, {dhi:+.3f}]" + (" lower" if order["lower_beyond_ci"] else "")
            print(line)
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from horizon.eval import compare, read_records

    if not args.thinking_cost >= 0:
        raise ValueError(f"--thinking-cost {args.thinking_cost}: allowed a number >= 0")
    a, b = read_records(args.a), read_records(args.b)
    if args.domains:  # models evaluated on different domain sets compare on the ones named
        names = [d for d in args.domains.split(",") if d]
        for path, records in ((args.a, a), (args.b, b)):
            have = {r["domain"] for r in records}
            if missing := sorted(set(names) - have):
                raise ValueError(f"--domains: {path} has no records of {missing}; it has {sorted(have)}")
        a, b = ([r for r in records if r["domain"] in names] for records in (a, b))
    res = compare(a, b, thinking_cost=args.thinking_cost)
    if args.json:
        print(json.dumps(res))
        return 0
    cost = (f"; reward net of a thinking cost of {args.thinking_cost} per whole budget" if args.thinking_cost
            else "")
    print(f"horizon compare: A = {args.a}, B = {args.b} (paired on the same held-out tasks; 95% intervals{cost})")
    print(f"{'domain':<20} {'n':>5} {'A':>7} {'B':>7} {'A - B':>7} {'95% CI':>17} {'normalised':>11} {'95% CI':>17}"
          f" {'only A':>7} {'only B':>7} {'think A':>8} {'think B':>8} {'change':>7}")
    for name, d in res["domains"].items():
        ci, nci = d["difference_ci95"], d["normalized_ci95"]
        change = "-" if d["thinking_change"] is None else f"{d['thinking_change']:+.0%}"
        print(f"{name:<20} {d['n']:>5} {d['accuracy_a']:>7.3f} {d['accuracy_b']:>7.3f} {d['difference']:>+7.3f} "
              f"{f'[{ci[0]:+.3f}, {ci[1]:+.3f}]':>17} {d['normalized_difference']:>+11.3f} "
              f"{f'[{nci[0]:+.3f}, {nci[1]:+.3f}]':>17} {d['only_a']:>7} {d['only_b']:>7} "
              f"{d['thinking_tokens_a']:>8.1f} {d['thinking_tokens_b']:>8.1f} {change:>7}")
    lo, hi = res["mean_normalized_ci95"]
    print(f"mean normalised reward{' (net of thinking)' if args.thinking_cost else ''}, A - B: "
          f"{res['mean_normalized_difference']:+.4f} [{lo:+.4f}, {hi:+.4f}]; "
          f"A better: {'yes' if res['a_better'] else 'no'}; no domain lower beyond its interval: "
          f"{'yes' if res['no_domain_lower'] else 'no'}")
    for label in ("a", "b"):
        order = res.get(f"tier_order_{label}")
        if not order:
            continue
        lower = [f"{domain}@{tier}" for domain, tiers in order.items() for tier, row in tiers.items()
                 if row.get("lower_beyond_ci")]
        print(f"tier order of {label.upper()}: " + ("every tier at least as accurate as low within its interval"
                                                     if not lower else f"below low beyond the interval: {lower}"))
    return 0


def _add_max_minutes(p: argparse.ArgumentParser) -> None:
    """train and rl: a wall-clock budget, so runs compared "for the same compute" stop at the same time."""
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop (and checkpoint) once this much wall-clock time has passed: a compute budget")


def _add_validation(p: argparse.ArgumentParser) -> None:
    """train and rl: held-out accuracy measured during the run (TrainConfig.eval_every)."""
    p.add_argument("--eval-every", type=int, default=0,
                   help="greedy held-out accuracy per domain every N steps and before the first (0: off); "
                        "logged to heldout.jsonl and plotted (train: horizon eval's limits; rl: the rollouts')")
    p.add_argument("--eval-n", type=int, default=50, help="with --eval-every: held-out tasks per domain")
    p.add_argument("--eval-seed", type=int, default=100_000,
                   help="with --eval-every: first held-out seed (default: a range apart from horizon eval's)")
    p.add_argument("--eval-tier", choices=["none", "low", "high", "max"], default="low",
                   help="with --eval-every: the thinking tier")


def _validation(args: argparse.Namespace) -> dict:
    return {"eval_every": args.eval_every, "eval_n": args.eval_n, "eval_seed": args.eval_seed,
            "eval_tier": None if args.eval_tier == "none" else args.eval_tier}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="horizon", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="parameters, weight and cache memory, GPUs needed for a config")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=list(PRESETS), default="k3")
    src.add_argument("--config", help="a config.json (or a checkpoint folder holding one)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens of context to plan for (default: the model's window, 1,048,576 for k3)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="also plan per rank for N tensor-parallel ranks: weights, KDA state, cache, sequences")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tp: the routed experts whole per rank")
    p.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="memory of one GPU for the per-rank plan (default 141GB; also e.g. 80GiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("quantize", help="rewrite a Horizon checkpoint with MXFP4 routed experts")
    p.add_argument("src", help="checkpoint folder to read")
    p.add_argument("dst", help="checkpoint folder to write")
    p.add_argument("--method", choices=["mxfp4"], default="mxfp4")
    p.set_defaults(func=_cmd_quantize)

    p = sub.add_parser("convert", help="write a Horizon checkpoint from a Horizon, Kimi-Linear or DeepSeek-V3.2 one")
    p.add_argument("src", help="checkpoint folder to read (config.json + safetensors)")
    p.add_argument("dst", help="checkpoint folder to write")
    p.add_argument("--quantize", choices=["mxfp4"], default=None, help="store the routed experts as MXFP4")
    p.add_argument("--to-dsa", action="store_true",
                   help="turn plain MLA layers into Gated DSA (fresh indexer and output gate, same logits)")
    p.add_argument("--index-topk", type=int, default=None, help="with --to-dsa: positions kept per query (2048)")
    p.add_argument("--index-heads", type=int, default=None, help="with --to-dsa: indexer heads (clamp(heads, 8, 64))")
    p.add_argument("--index-head-dim", type=int, default=None, help="with --to-dsa: indexer head dim (64 or 128)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("export", help="write a model in another engine's layout (Kimi K3's, for vLLM, SGLang, "
                                      "llama.cpp, mlx-lm)")
    p.add_argument("model", help="checkpoint folder to read (Horizon or any format horizon loads)")
    p.add_argument("out", help="folder to write")
    p.add_argument("--format", choices=["kimi-k3"], default="kimi-k3")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the trunk's dtype in the files (default: the model's; K3 ships bfloat16)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("inspect", help="check a checkpoint from its config and safetensors headers alone "
                                       "(names, shapes, dtypes, quantisation) and print its counts, bytes and plan")
    p.add_argument("folder", help="checkpoint folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_inspect)

    def parallel(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="shard every layer over N ranks (started here; or run under torchrun with "
                            "WORLD_SIZE=N, across machines: docs/parallel.md)")
        p.add_argument("--enable-expert-parallel", action="store_true",
                       help="spread the routed experts whole over the N ranks instead of splitting each one")

    def weight_formats(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dense-weights", choices=["full", "int8"], default="full",
                       help="int8: hold the dense projections (attention, dense MLP, shared experts, LM head) as "
                            "int8 with per-row scales, converted at load (~1/4 of fp32's bytes; docs/model.md)")
        p.add_argument("--mxfp4-activations", choices=["fp32", "int8"], default="fp32",
                       help="int8: round what the MXFP4 experts multiply to int8 per 32 values first (llama.cpp's "
                            "Q8_0 way; AVX-512 VNNI or AVX2): faster, ~0.5%% relative error in their outputs "
                            "(docs/model.md)")

    def sampling(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
        p.add_argument("--tier", choices=["low", "high", "max"], default=None, help="thinking tier (default: off)")
        p.add_argument("--max-tokens", type=int, default=256)
        p.add_argument("--temperature", type=float, default=0.7)
        p.add_argument("--top-p", type=float, default=0.95)
        p.add_argument("--seed", type=int, default=None)
        weight_formats(p)

    p = sub.add_parser("generate", help="answer one prompt, streaming thinking and answer")
    p.add_argument("--prompt", required=True)
    sampling(p)
    parallel(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("chat", help="an interactive conversation that keeps the full history")
    p.add_argument("--system", default=None, help="a system message")
    sampling(p)
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("serve", help="the OpenAI- and Anthropic-compatible HTTP server")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    p.add_argument("--served-model-name", default=None, help="the model id the APIs report")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None,
                   help="require this key; repeat for several, each a tenant of its own (stored thinking is kept "
                        "per tenant; default: $HORIZON_API_KEY, else no authentication)")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="more keys, one per line: KEY or TENANT:KEY (keys naming one tenant share it)")
    p.add_argument("--history-policy", choices=["reject", "strict", "warn"], default="reject",
                   help="what to do with tool-call turns that lost their thinking and that the server cannot "
                        "restore from its own memory (docs/design.md §3)")
    p.add_argument("--thinking-store-mb", type=float, default=64,
                   help="memory for the thinking turns kept to restore for clients that drop them (0: off)")
    p.add_argument("--responses-db", default=None, metavar="PATH",
                   help="the Responses API's store (SQLite; default: ~/.local/state/horizon/responses.sqlite3; "
                        ":memory: keeps nothing across restarts)")
    p.add_argument("--responses-retention-days", type=float, default=30,
                   help="stored responses older than this are deleted")
    p.add_argument("--reasoning-key-file", default=None,
                   help="AES-GCM keys sealing Responses reasoning.encrypted_content, newest first "
                        "(default: beside the signature key)")
    p.add_argument("--signature-key-file", default=None,
                   help="HMAC key for thinking signatures (default: ~/.local/state/horizon/thinking-signature.key)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context window served (default: the model's, at most 32768); larger than the model's is "
                        "an error")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per forward (chunked prefill)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429/529")
    p.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument("--header-timeout", type=float, default=10, metavar="S",
                   help="close a connection whose request headers are not complete after S seconds")
    p.add_argument("--body-timeout", type=float, default=30, metavar="S",
                   help="answer 408 when a request body stalls for S seconds")
    p.add_argument("--drain-timeout", type=float, default=30, metavar="S",
                   help="on SIGTERM, let running requests finish for up to S seconds, then end their streams with "
                        "an error event and exit")
    p.add_argument("--no-playground", action="store_true", help="leave out the web playground (the page at /)")
    p.add_argument("--playground-root", default=None, metavar="DIR",
                   help="the folder the playground's `files` tool may read and write (default: no `files` tool)")
    p.add_argument("--playground-allowed-host", action="append", default=[], metavar="NAME",
                   help="a host name the playground may be reached by besides IP addresses and localhost "
                        "(repeatable; other names are refused, which stops DNS rebinding)")
    p.add_argument("--no-weight-check", action="store_true",
                   help="skip the check for NaN / infinite weights at load (it costs ~4 ms on the bundled model, "
                        "~60 ms on the bf16 `small` preset)")
    weight_formats(p)
    p.add_argument("--prefix-cache-mb", type=float, default=256,
                   help="memory for the KDA state snapshots that let later requests resume a shared prefix")
    p.add_argument("--prefix-snapshot-turns", type=int, default=2, metavar="K",
                   help="snapshot the state at the last K message boundaries of each prompt (and where the "
                        "system prompt ends), so branches of one history share it (see `horizon plan` for a "
                        "snapshot's size)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no compiled decode graphs (without it they compile in the "
                        "background from startup, a step running eagerly until its graph is ready: on 2 cores "
                        "half a minute to two minutes a graph the first time, seconds with the cache in "
                        "TORCHINDUCTOR_CACHE_DIR)")
    p.add_argument("--coverage-every", type=int, default=64,
                   help="measure the DSA top-k's share of dense attention every N decode steps (0: off)")
    p.add_argument("--allow-local-images", default=None, metavar="DIR",
                   help="accept image parts that name files under DIR (default: base64 data URLs only)")
    p.add_argument("--log-level", default="info")
    parallel(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("agent", help="work on a task with tools, streaming thinking, calls and results")
    p.add_argument("task", nargs="?", default=None, help="what to do (the first user message)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="checkpoint folder served in-process (default: the bundled model)")
    src.add_argument("--base-url", default=None, help="an OpenAI- or Anthropic-compatible server (its root URL)")
    p.add_argument("--api", choices=["openai", "anthropic"], default="openai", help="the wire format to speak")
    p.add_argument("--api-key", default=None, help="default: $HORIZON_API_KEY")
    p.add_argument("--served-model", default=None, help="the model id to ask for (default: the first listed)")
    p.add_argument("--tools", default="calculator",
                   help="comma-separated: calculator, files, shell, terminal (default: calculator)")
    p.add_argument("--root", default=None, help="the folder files and shell may use (required for them)")
    p.add_argument("--tier", choices=["low", "high", "max"], default=None, help="thinking tier (default: off)")
    p.add_argument("--force-tool", default=None, metavar="required|NAME",
                   help="force a tool call on the first step (any tool, or the named one)")
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=None, help="completion tokens over all steps")
    p.add_argument("--max-tokens-per-step", type=int, default=1024)
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--transcript", default=None, help="write every request, response and tool call here (JSONL)")
    p.add_argument("--no-stream", action="store_true", help="ask for whole responses instead of streams")
    p.add_argument("--replay", default=None, metavar="TRANSCRIPT",
                   help="run a recorded session again, checking every request against the recorded one")
    p.add_argument("--rerun-tools", action="store_true", help="with --replay: execute the tools again")
    p.set_defaults(func=_cmd_agent)

    p = sub.add_parser("train", help="supervised training on task domains and/or your own chats (resumable)")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, train_log.jsonl, train_curves.png")
    init = p.add_mutually_exclusive_group()
    init.add_argument("--init", default=None,
                      help="start from this checkpoint folder (\"bundled\": the shipped horizon-tiny)")
    init.add_argument("--preset", default="tiny", choices=list(PRESETS), help="or from random weights (default tiny)")
    p.add_argument("--domains", default=None, help="comma-separated task domains (horizon.tasks), e.g. image")
    p.add_argument("--data", default=None, help="a JSONL of chats: {\"messages\": [...], \"tools\"?, \"tier\"?}")
    p.add_argument("--ratios", default=None, help="sampling ratios, one per source (domains, then data)")
    p.add_argument("--per-domain", type=int, default=1000, help="training tasks generated per domain")
    p.add_argument("--tier", default="low", metavar="TIER[,TIER...]",
                   help="tier stated for thinking targets (low, high or max); a list such as low,high,max renders "
                        "the domains' tasks under each in turn")
    p.add_argument("--thinking-budgets", default=None, metavar="LOW,HIGH,MAX",
                   help="thinking-token caps per tier written to the checkpoint's generation config")
    p.add_argument("--brief", type=float, default=0.0, metavar="SHARE",
                   help="share of the references of domains that offer a brief thought (passkey, recall) rendered "
                        "with it instead of the full one: thoughts of varied length to learn from (default 0)")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps (default 200; with --resume: the new end)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--stage", choices=["sft", "dense", "indexer-warmup", "sparse"], default="sft",
                   help="sft; dense (sft with dense attention: the base the indexer stages start from); "
                        "indexer-warmup (dense attention, only the DSA indexers learn); sparse (top-k on)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    _add_max_minutes(p)
    _add_validation(p)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("rl", help="joint RL across task domains (GRPO, per-domain reward normalisation)")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, rl_log.jsonl, rl_curves.png")
    p.add_argument("--init", default="bundled", help="the SFT checkpoint to start from (default: the bundled model)")
    p.add_argument("--domains", default="arithmetic,passkey-short,terminal,convert,image",
                   help="comma-separated task domains (horizon.tasks) trained jointly")
    p.add_argument("--ratios", default=None, help="domain sampling ratios, one per domain (default: equal)")
    p.add_argument("--adaptive", action="store_true", help="favour domains whose accuracy is neither ~0 nor ~1")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps (default 100; with --resume: the new end)")
    p.add_argument("--prompts", type=int, default=4, help="tasks per step")
    p.add_argument("--group", type=int, default=4, help="rollouts per task (the GRPO group)")
    p.add_argument("--tiers", default="low", help="thinking tiers sampled per rollout, e.g. none,low,high")
    p.add_argument("--tier-per-group", action="store_true",
                   help="draw the tier once per task, so a group's rollouts share it (the baseline then compares "
                        "thinking under one budget)")
    p.add_argument("--thinking-cost", type=float, default=0.0,
                   help="cost of a whole thinking budget, in standard deviations of the domain's reward")
    p.add_argument("--kl", type=float, default=0.0, help="KL penalty to the initial policy (0: off)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (cosine after the warm-up)")
    p.add_argument("--warmup", type=int, default=5, help="linear warm-up steps")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="rollout sampling temperature; the loss's log-probabilities use the same")
    p.add_argument("--episode-steps", type=int, default=4, help="model calls per rollout")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per model call")
    p.add_argument("--max-len", type=int, default=2048, help="tokens per rollout in the loss")
    p.add_argument("--no-indexer-loss", action="store_true", help="stop training the DSA indexers during RL")
    p.add_argument("--group-std", action="store_true",
                   help="divide advantages by the group's standard deviation too (the original GRPO)")
    p.add_argument("--clip", type=float, default=5.0, help="advantages are clipped to +-CLIP")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward in an update")
    p.add_argument("--train-flat", action="store_true",
                   help="run the update on rollouts with advantage 0 too: the same policy gradient, but the KL "
                        "and indexer terms see them as well, at several times the cost near the ceiling")
    p.add_argument("--guide", action="store_true",
                   help="add each task's reference trajectory to its group as one more member scored 1.0 "
                        "(off-policy guidance): a task the model fails in every sample still teaches it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--log-every", type=int, default=10, help="with --no-progress: a log line every N steps")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its checkpoint, with its own settings (only --steps moves)")
    _add_max_minutes(p)
    _add_validation(p)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_rl)

    p = sub.add_parser("eval", help="held-out tasks per domain: accuracy with a 95%% CI, tool-call validity, thinking")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    p.add_argument("--tier", choices=["none", "low", "high", "max"], default=None,
                   help="the thinking tier (default low)")
    p.add_argument("--tiers", default=None, metavar="TIER,TIER...",
                   help="several tiers in one run, e.g. low,high,max: a table per domain and tier, and each "
                        "tier against the first on the same tasks")
    p.add_argument("--domains", default="arithmetic,passkey-short,terminal,convert,image")
    p.add_argument("--n", type=int, default=100, help="held-out tasks per domain")
    p.add_argument("--max-steps", type=int, default=6, help="model calls per task")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per model call (thinking included)")
    p.add_argument("--batch", type=int, default=16, help="episodes decoded together")
    p.add_argument("--seed", type=int, default=0, help="first held-out seed")
    p.add_argument("--selection", choices=["indexer", "recent"], default="indexer",
                   help="DSA selection: the learned indexer, or the most recent index_topk positions (ablation)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype of the non-expert weights (default: the checkpoint's)")
    p.add_argument("--records", default=None, metavar="JSONL",
                   help="write one line per task: id, reward, answer, reference and the whole conversation")
    p.add_argument("--json", action="store_true")
    parallel(p)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("compare", help="two models' eval records on the same tasks: paired differences, 95%% CIs")
    p.add_argument("a", help="records of model A (horizon eval --records)")
    p.add_argument("b", help="records of model B, the baseline")
    p.add_argument("--thinking-cost", type=float, default=0.0,
                   help="charge each record this much per whole thinking budget of its tier, in standard "
                        "deviations of its domain's reward (horizon rl's --thinking-cost): the normalised "
                        "difference is then of reward net of thinking")
    p.add_argument("--domains", default=None,
                   help="compare only these comma-separated domains (both record sets must hold them)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a launcher re-runs on each rank
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"horizon {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
