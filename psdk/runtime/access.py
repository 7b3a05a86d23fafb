"""Who may read what psdk writes: run folders, checkpoints, summaries, figures, logs.

A host shared by several teams must not hand one team's model to another:
``params.npz`` is the trained model, and checkpoints, metrics and events say
what it learnt. So a psdk command sets its process's umask before it writes
anything, and every task it starts inherits it: with ``file_access=owner``
(the default) files are 0600 and folders 0700. A team that shares a group
widens it with ``file_access=group`` (0640/0750), or ``all`` (0644/0755, as
most tools write). Key folders stay 0700 and secrets 0600 whatever this says
(:mod:`psdk.transport.security`); decoded-data cache entries stay 0600.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from psdk.errors import ConfigError

KEY = "file_access"
UMASKS = {"owner": 0o077, "group": 0o027, "all": 0o022}
DEFAULT = "owner"


def umask_for(value: object) -> int:
    """The umask of a ``file_access`` value; a ConfigError naming the choices for anything else."""
    umask = UMASKS.get(str(value))
    if umask is None:
        raise ConfigError(KEY, f"must be one of {', '.join(UMASKS)}, got {value!r}", tuple(UMASKS))
    return umask


def apply(value: object) -> None:
    """Set this process's umask (its children inherit it): files psdk writes from now on follow it."""
    os.umask(umask_for(value))


def from_args(args: Sequence[str]) -> str:
    """``file_access`` as given on a command line (``file_access=group``, or ``--file_access=group``), else owner."""
    for arg in args:
        key, sep, value = arg.lstrip("+-~").partition("=")
        if sep and key == KEY:
            return value
    return DEFAULT


def file_mode() -> int:
    """The mode a new file gets under the current umask (for files made with a fixed mode, as mkstemp's 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
