"""The chief's consistent cut: every shard's variables and slots at one global step, for a checkpoint.

Every shard is asked to stop applying pushes at one version (the pause is
the chief session's lease on the ps, see :mod:`psdk.ps.checkpoints`), their
state is read, and they resume. A pause that lapsed on the way makes the
cut inconsistent: that checkpoint is skipped (:class:`CheckpointAbandoned`),
never written. Embedding tables are read while the pause still holds, chunk
by chunk, straight into the checkpoint's file (:mod:`psdk.client.tablestate`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from psdk.client.checkpoint import Checkpoint
from psdk.client.shards import Requests, Shard
from psdk.client.tablefile import CheckpointWriter
from psdk.client.tablestate import DEFAULT_CHUNK_ROWS, read_tables
from psdk.errors import CheckpointAbandoned, PsdkError, RemoteError, TransportError
from psdk.protocol.sharding import views
from psdk.protocol.tables import TableSpec
from psdk.runtime.disks import WriteError
from psdk.runtime.failpoints import CHECKPOINT_PAUSED, failpoint
from psdk.transport.wire import Message


def checkpoint_cut(
    client: Requests,
    shards: Sequence[Shard],
    creation_order: Sequence[str],
    max_rounds: int = 50,
    tables: Mapping[str, TableSpec] | None = None,
    folder: Path | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> Checkpoint:
    """Chief: a consistent cut of every shard at one global step, collected over the transport.

    Every shard is asked to stop applying pushes once it reaches the
    highest version any shard has (pushes beyond it wait on the ps); a
    shard already past it raises the target. Once all stand at the same
    version their variables and slots are read and the shards resume. A
    shard that holds no variable (more ps tasks than variables) is left out:
    no push reaches it, so its version never moves; with ``tables`` every
    shard holds rows, takes every push and is paused.

    The tables' chunks go into a checkpoint file begun in ``folder`` (the
    system's temporary folder if ``None``), which :func:`~psdk.client.checkpoint.save`
    finishes: the returned checkpoint's ``writer``.
    """
    held = [index for index, shard in enumerate(shards) if shard.size or tables]
    writer: CheckpointWriter | None = None

    def to_held(op: str, **fields: Any) -> dict[int, Message]:
        return {index: client.message(op, **fields) for index in held}

    versions = client.request(to_held("status"), "shard versions for a checkpoint")
    target = max(int(r.fields["version"]) for r in versions.values())
    failed = True
    try:
        for _ in range(max_rounds):
            replies = client.request(
                to_held("pause_at", version=target),
                f"every shard to reach version {target} for a checkpoint",
            )
            passed = [int(r.fields["version"]) for r in replies.values() if r.op == "passed"]
            if not passed:
                break
            target = max(passed)
        else:
            raise PsdkError(f"the shards did not settle on one version in {max_rounds} rounds")
        failpoint(CHECKPOINT_PAUSED)
        states = client.request(to_held("state"), "the shards' state for a checkpoint")
        if tables:
            writer = CheckpointWriter(folder or Path(tempfile.gettempdir()))
            read_tables(client, held, tables, writer, target, chunk_rows)
        failed = False
    except RemoteError as exc:
        if exc.kind != "not_paused":
            raise
        raise CheckpointAbandoned(f"the checkpoint pause ended before every state was read: {exc}") from exc
    except OSError as exc:  # the file the table chunks stream into
        raise WriteError(writer.tmp if writer is not None else folder or "a checkpoint file", exc,
                         "checkpoint.dir") from None  # fmt: skip
    finally:
        if failed and writer is not None:
            writer.discard()
        try:
            client.request(to_held("resume"), "resuming after a checkpoint")
        except TransportError:
            if not failed:
                raise  # else the first error says more
    try:
        checkpoint = _assemble(client, shards, creation_order, states, target)
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    checkpoint.writer = writer
    return checkpoint


def _assemble(
    client: Requests,
    shards: Sequence[Shard],
    creation_order: Sequence[str],
    states: Mapping[int, Message],
    version: int,
) -> Checkpoint:
    variables: dict[str, np.ndarray] = {}
    slots: dict[str, dict[str, np.ndarray]] = {}
    rule: dict[str, Any] = {}
    rule_step = 0
    for index in sorted(states):
        reply = states[index]
        if int(reply.fields["version"]) != version:  # a pause lapsed between the reads
            raise CheckpointAbandoned(
                f"{client.names[index]} was at version {reply.fields['version']}, not {version}, "
                "when its state was read: the checkpoint would not be a consistent cut"
            )
        specs = shards[index].specs
        variables.update({n: v.copy() for n, v in views(reply.arrays[0], specs).items()})
        for slot, flat in zip(reply.fields["slots"], reply.arrays[1:], strict=True):
            slots.setdefault(slot, {}).update({n: v.copy() for n, v in views(flat, specs).items()})
        if index == 0:
            rule, rule_step = dict(reply.fields["rule"]), int(reply.fields["rule_step"])
    order = list(creation_order) or [s.name for shard in shards for s in shard.specs]
    return Checkpoint(
        global_step=version,
        variables={n: variables[n] for n in order},
        slots={s: {n: by_name[n] for n in order} for s, by_name in slots.items()},
        rule=rule,
        rule_step=rule_step,
    )
