"""`python -m horizon ...` (and `torchrun ... -m horizon ...`): the horizon command."""

import sys

from horizon.cli import main

if __name__ == "__main__":  # importing the module (pkgutil.walk_packages does) must not run the command
    sys.exit(main())
