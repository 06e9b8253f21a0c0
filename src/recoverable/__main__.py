"""``python -m recoverable``: the same command line as the ``recoverable`` script."""

from __future__ import annotations

import sys

from recoverable.cli import main

if __name__ == "__main__":
    sys.exit(main())
