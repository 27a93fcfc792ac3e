"""``python -m fp8dist ...`` is the ``fp8dist`` command."""

import sys

from .cli import main

sys.exit(main())
