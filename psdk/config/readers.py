"""Which command reads which key: a key given to a command that never reads it is refused, not ignored.

``python -m psdk run weights=params.npz`` used to train from scratch and say
nothing: ``weights`` is what ``evaluate`` evaluates. The keys below are
read by some commands only; the rest of the tree is read by every command
that starts a job (``run`` passes them on to its tasks).
"""

from __future__ import annotations

from collections.abc import Iterable

from psdk.errors import ConfigError

PER_TASK = ("ps", "worker", "task")
"""The commands that run one task of a cluster started by hand."""
BY_HAND = (
    "`run` starts every task itself and gives each its own; the key is for a task started by hand "
    "(python -m psdk ps|worker|task)"
)

READ_BY: dict[str, tuple[tuple[str, ...], str]] = {
    "weights": (
        ("evaluate",),
        "it names the parameters `python -m psdk evaluate weights=PATH` tests; a job starts from "
        "resume=<checkpoint> (or from model.init)",
    ),
    "task_index": (PER_TASK, BY_HAND),
    "ps_hosts": (PER_TASK, BY_HAND),
    "worker_hosts": (PER_TASK, BY_HAND),
    "ps_hosts_from": (PER_TASK, BY_HAND),
    "ps.announce_file": (PER_TASK, BY_HAND),
    "ps.progress_file": (PER_TASK, BY_HAND),
    "liveness.file": (PER_TASK, BY_HAND),
}
"""Keys only some commands read: ``key -> (the commands that read it, why, for the others' error)``."""


def given_keys(overrides: Iterable[str]) -> list[str]:
    """The keys ``key=value`` overrides set (``+key=`` too; ``~key`` deletions set none)."""
    return [text.split("=", 1)[0].lstrip("+") for text in overrides if "=" in text and not text.startswith("~")]


def refuse_ignored(command: str, overrides: Iterable[str]) -> None:
    """Refuse a key ``command`` would ignore, naming the key, who reads it, and why."""
    for key in given_keys(overrides):
        readers = READ_BY.get(key)
        if readers is None or command in readers[0]:
            continue
        commands, why = readers
        names = " and ".join(f"`{c}`" for c in commands)
        raise ConfigError(key, f"`python -m psdk {command}` does not read it (only {names}): {why}; drop it")
