"""``python -m psdk``."""

import sys

from psdk.cli import main, task_exit

code = main()
if len(sys.argv) > 1 and sys.argv[1] in ("ps", "worker", "task"):
    task_exit(code)
sys.exit(code)
