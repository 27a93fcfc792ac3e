"""``python -m fp8dist.cli``: what the torchrun / deepspeed launch scripts start on every rank."""

import sys

from . import main

sys.exit(main())
