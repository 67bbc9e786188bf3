"""``python -m fsdp.demo`` is ``fsdp-demo``."""

import sys

from fsdp.demo.cli import main

sys.exit(main())
