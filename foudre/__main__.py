"""``python -m foudre`` is the ``foudre`` command."""

import sys

from foudre.cli import main

sys.exit(main())
