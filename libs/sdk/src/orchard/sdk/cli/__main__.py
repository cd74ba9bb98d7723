"""``python -m orchard.sdk.cli``: the same as the ``orchard`` command."""

import sys

from orchard.sdk.cli import main

sys.exit(main())
