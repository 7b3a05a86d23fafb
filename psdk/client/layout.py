"""Where the job's variables live: the init requests that place them on the shards, and the map back.

The chief sends each shard its variables (``init``); every worker then gets
each shard's layout (names, shapes, version, job) in the replies and builds
its flat buffers and named views from them. Kept apart from
:mod:`psdk.client.client`, whose class is about talking to the shards, not
about how variables are laid out on them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from psdk.client.checkpoint import Checkpoint
from psdk.client.partitions import split_arrays, split_state
from psdk.client.shards import Shard
from psdk.errors import PsdkError
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.partitions import groups
from psdk.protocol.sharding import assign_shards, flat_size, layout, views
from psdk.protocol.tables import TableSpec
from psdk.rules import UpdateRule
from psdk.transport import ClientEndpoint
from psdk.transport.wire import Message

MakeRequest = Callable[..., Message]


def checked_variables(
    variables: Mapping[str, np.ndarray], rule: UpdateRule, restore: Checkpoint | None
) -> Mapping[str, np.ndarray]:
    """The variables to place: the model's, or a checkpoint's once it is shown to fit the model and the rule."""
    if restore is None:
        return variables
    restore.check_matches({n: tuple(np.shape(v)) for n, v in variables.items()})
    expected = set(rule.slot_names())
    if set(restore.slots) != expected:
        raise PsdkError(
            f"the checkpoint keeps optimizer slots {sorted(restore.slots)} "
            f"({restore.rule.get('name')}) but optimizer={rule.name} keeps {sorted(expected)}: "
            f"resume with optimizer={restore.rule.get('name')}"
        )
    return restore.variables


def initial_state(variables: Mapping[str, np.ndarray], rule: UpdateRule, restore: Checkpoint | None) -> Checkpoint:
    """What a recovery restores when the chief has no checkpoint yet: the job as it started."""
    return restore or Checkpoint(
        global_step=0,
        variables={n: np.array(v, np.float32) for n, v in variables.items()},
        slots={s: {n: np.zeros(np.shape(v), np.float32) for n, v in variables.items()} for s in rule.slot_names()},
        rule=rule.to_json(),
    )


def init_requests(
    request: MakeRequest,
    variables: Mapping[str, np.ndarray],
    job: JobSpec,
    rule: UpdateRule,
    num_ps: int,
    sharding: str,
    restore: Checkpoint | None,
    epoch: int = 0,
    tables: Sequence[TableSpec] = (),
    plan: Mapping[str, int] | None = None,
) -> dict[int, Message]:
    """One ``init`` per shard: the variables ``sharding`` places there (with ``restore``, its slots and step too).

    ``plan``: the variables split into parts (:mod:`psdk.protocol.partitions`), each part placed as a variable.
    """
    plan = plan or {}
    variables = split_arrays(variables, plan)
    restore = split_state(restore, plan) if restore is not None else None
    order = [(name, tuple(np.shape(value))) for name, value in variables.items()]
    placement = assign_shards(order, num_ps, sharding, groups(plan))
    messages = {}
    for index in range(num_ps):
        names = [name for name, _ in order if placement[name] == index]
        arrays = [np.ascontiguousarray(variables[n], dtype=np.float32) for n in names]
        fields: dict[str, Any] = {"job": job.to_json(), "rule": rule.to_json(), "names": names}
        if epoch:
            fields["epoch"] = epoch
        if tables:
            fields["tables"] = {"shard": index, "num_ps": num_ps, "specs": [t.to_json() for t in tables]}
        if restore is not None:
            slot_names = list(restore.slots)
            fields["restore"] = {"version": restore.global_step, "rule_step": restore.rule_step, "slots": slot_names}
            arrays += [np.ascontiguousarray(restore.slots[s][n], dtype=np.float32) for s in slot_names for n in names]
        messages[index] = request("init", arrays, **fields)
    return messages


def shards_from(
    replies: Mapping[int, Message], endpoint: ClientEndpoint, num_ps: int
) -> tuple[list[Shard], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each shard's buffers (from the transport, which may lend them to the ps) and the named views into them."""
    shards, params, grads = [], {}, {}
    extra = table_arrays(tables_of(replies).values())
    for index in range(num_ps):
        fields = replies[index].fields
        specs = layout([(n, tuple(s)) for n, s in zip(fields["names"], fields["shapes"], strict=True)])
        buffers = endpoint.buffers(index, flat_size(specs), *extra)
        shard = Shard(specs, int(fields["version"]), buffers.params, buffers.grads, buffers.outbox)
        shards.append(shard)
        params.update(views(shard.params, specs))
        grads.update(views(shard.grads, specs))
    return shards, params, grads


def table_arrays(tables: Collection[TableSpec]) -> tuple[int, int]:
    """The bytes and the number of one push's table arrays to a shard at their most: what the transport may
    lend room for (:meth:`TableSpec.request_bytes`; three arrays a table)."""
    return sum(spec.request_bytes() for spec in tables), 3 * len(tables)


def job_of(replies: Mapping[int, Message]) -> JobSpec:
    """The job every shard was initialised for; shards of different jobs are an error."""
    if len({repr(reply.fields["job"]) for reply in replies.values()}) > 1:
        raise PsdkError("the ps shards were initialised for different jobs: restart every ps task")
    return JobSpec.from_json(replies[0].fields["job"])


def tables_of(replies: Mapping[int, Message]) -> dict[str, TableSpec]:
    """The job's embedding tables, as every shard's layout names them (shards that disagree are an error)."""
    declared = {repr(reply.fields.get("tables") or []) for reply in replies.values()}
    if len(declared) > 1:
        raise PsdkError("the ps shards hold different embedding tables: restart every ps task")
    specs = [TableSpec.from_json(spec) for spec in next(iter(replies.values())).fields.get("tables") or []]
    return {spec.name: spec for spec in specs}
