"""The `horizon` command line.

    horizon plan --preset 2.8t [--context N] [--json]    parameters, memory and GPUs for a config
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
