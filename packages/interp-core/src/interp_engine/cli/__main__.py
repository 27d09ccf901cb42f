"""``python -m interp_engine.cli``: the ``interp`` command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
