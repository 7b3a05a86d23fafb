"""Which ps shard holds which variable, decided the same way on every task.

``round_robin`` deals variables to ps tasks in creation order, as
TensorFlow's ``replica_device_setter`` does by default; ``greedy`` gives each
variable, in creation order, to the shard with the fewest bytes so far (ties
to the lowest index), as its ``GreedyLoadBalancingStrategy`` does. Both put
the first variable on shard 0, so shard 0 always holds something and can
keep the global step. The parts of a partitioned variable
(:mod:`psdk.protocol.partitions`) are variables of their own here; greedy
keeps them on different shards while there are shards without one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from psdk.errors import ConfigError
from psdk.protocol.partitions import expand, groups
from psdk.transport.wire import MAX_HEADER_BYTES

STRATEGIES = ("round_robin", "greedy")


@dataclass(frozen=True)
class VarSpec:
    """Where one variable lives inside its shard's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def assign_shards(
    variables: Sequence[tuple[str, tuple[int, ...]]],
    num_ps: int,
    strategy: str = "round_robin",
    apart: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """Map each variable name to its ps index.

    ``apart``: part name -> its variable's (:func:`~psdk.protocol.partitions.groups`); round robin deals a
    variable's consecutive parts to consecutive shards anyway.
    """
    if num_ps < 1:
        raise ConfigError("topology.num_ps", f"must be at least 1, got {num_ps}")
    if strategy not in STRATEGIES:
        raise ConfigError("topology.sharding", f"unknown strategy {strategy!r}", STRATEGIES)
    names = [name for name, _ in variables]
    if len(set(names)) != len(names):
        raise ConfigError("model", "variable names must be unique")
    if strategy == "round_robin":
        return {name: i % num_ps for i, name in enumerate(names)}
    load = [0] * num_ps
    placement: dict[str, int] = {}
    taken: dict[str, set[int]] = {}
    for name, shape in variables:
        group = (apart or {}).get(name)
        held = taken.setdefault(group, set()) if group is not None else set()
        free = [i for i in range(num_ps) if i not in held] or list(range(num_ps))
        shard = min(free, key=lambda i: (load[i], i))
        held.add(shard)
        placement[name] = shard
        load[shard] += int(np.prod(shape, dtype=np.int64)) * 4
    return placement


def shard_sizes(
    variables: Sequence[tuple[str, tuple[int, ...]]],
    num_ps: int,
    strategy: str = "round_robin",
    plan: Mapping[str, int] | None = None,
) -> list[int]:
    """The floats each ps shard holds, by index: what :func:`assign_shards` puts there (``plan``'s parts split)."""
    sizes = [0] * num_ps
    held = expand(variables, plan or {})
    placement = assign_shards(held, num_ps, strategy, groups(plan or {}))
    for name, shape in held:
        sizes[placement[name]] += int(np.prod(shape, dtype=np.int64))
    return sizes


def largest_message_bytes(size: int, slots: int) -> int:
    """The largest message a peer of a job can legitimately send a shard of ``size`` floats: the chief's restore.

    It carries every variable and each of the update rule's ``slots`` of the
    shard (a push carries the variables once), and a header. The ps limits
    its messages to this once the job is known; before that, the job's
    ``transport.max_message_bytes`` must let it through.
    """
    return (1 + slots) * 4 * size + MAX_HEADER_BYTES


def layout(variables: Sequence[tuple[str, tuple[int, ...]]]) -> list[VarSpec]:
    """Offsets of ``variables`` packed back to back in one flat float32 buffer."""
    specs, offset = [], 0
    for name, shape in variables:
        spec = VarSpec(name, tuple(int(d) for d in shape), offset)
        specs.append(spec)
        offset += spec.size
    return specs


def flat_size(specs: Sequence[VarSpec]) -> int:
    return specs[-1].offset + specs[-1].size if specs else 0


def views(flat: np.ndarray, specs: Sequence[VarSpec]) -> dict[str, np.ndarray]:
    """Named views into ``flat``; writing a view writes the buffer."""
    return {s.name: flat[s.offset : s.offset + s.size].reshape(s.shape) for s in specs}
