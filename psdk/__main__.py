"""``python -m psdk``."""

import sys

from psdk.launch.cli import main, task_exit

command = sys.argv[1] if len(sys.argv) > 1 else ""  # read first: running Hydra rewrites sys.argv
try:
    code = main()
except SystemExit as exc:  # a failed job or task ends this way too, and must skip the teardown as well
    if isinstance(exc.code, str):
        print(exc.code, file=sys.stderr)
    code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
# A task, or a local launcher whose tasks are all reaped (Ray's own exit handlers must run): no teardown.
# A failed job included: tearing the interpreter down after one aborted the launcher in 5 of 8 runs of
# tests/test_disks.py's final-checkpoint case ("terminate called without an active exception", exit -6).
if command in ("ps", "worker", "task") or (command == "run" and "ray" not in sys.modules):
    task_exit(code)
sys.exit(code)
