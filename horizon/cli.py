"""The `horizon` command line."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("horizon: no commands yet", file=sys.stderr)
    return 2
