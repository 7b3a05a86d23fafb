"""``python -m psdk``."""

import sys

from psdk.cli import main

sys.exit(main())
