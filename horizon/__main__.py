"""`python -m horizon ...` (and `torchrun ... -m horizon ...`): the horizon command."""

import sys

from horizon.cli import main

sys.exit(main())
