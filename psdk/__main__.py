"""``python -m psdk``."""

import sys

from psdk.launch.cli import main, task_exit

command = sys.argv[1] if len(sys.argv) > 1 else ""  # read first: running Hydra rewrites sys.argv
code = main()
# A task, or a local launcher whose tasks are all reaped (Ray's own exit handlers must run): no teardown.
if command in ("ps", "worker", "task") or (command == "run" and "ray" not in sys.modules):
    task_exit(code)
sys.exit(code)
