"""The `horizon` command line.

    horizon plan --preset 2.8t [--context N] [--json]       parameters, memory and GPUs for a config
    horizon quantize SRC DST                                 store a checkpoint's routed experts as MXFP4
    horizon convert SRC DST [--quantize mxfp4] [--to-dsa]   a Kimi-Linear / DeepSeek-V3.2 folder -> Horizon
"""

from __future__ import annotations

import argparse
import json
import sys

from horizon.config import ModelConfig
from horizon.presets import PRESETS


def _cmd_plan(args: argparse.Namespace) -> int:
    from horizon.plan import plan, render_plan

    if args.config:
        config, name = ModelConfig.load(args.config), args.config
    else:
        config, name = ModelConfig.preset(args.preset), args.preset
    result = plan(config, context=args.context)
    if args.json:
        print(json.dumps(result))
    else:
        render_plan(name, result)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="horizon", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="parameters, weight and cache memory, GPUs needed for a config")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=list(PRESETS), default="2.8t")
    src.add_argument("--config", help="a config.json (or a checkpoint folder holding one)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens of context to plan for (default: the model's window, 1,048,576 for 2.8t)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"horizon {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
