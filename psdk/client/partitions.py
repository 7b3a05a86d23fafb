"""A partitioned variable as the worker sees it: one whole array, though its parts live on several shards.

The shards hold the parts (``hidden1/kernel/part_0``, ``.../part_1``, see
:mod:`psdk.protocol.partitions`), each in its own shard's flat buffer. A
backend must see one variable, so the client keeps a whole buffer of
parameters and one of gradients per partitioned variable: :meth:`Joined.gather`
copies the parts into the whole after each pull or reply, and
:meth:`Joined.scatter` copies the whole gradient into the parts before each
push: one memcpy of the variable each way per step. Checkpoints hold the
whole variable by its own name (:meth:`Joined.join_state`), so a job resumes
with any number of ps tasks or parts; a restore splits it again
(:func:`split_state`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np

from psdk.client.checkpoint import Checkpoint
from psdk.errors import PsdkError
from psdk.protocol.partitions import Partitioning, part_name

T = TypeVar("T")
log = logging.getLogger(__name__)


def chosen_plan(partitioning: Partitioning | None, variables: Mapping[str, np.ndarray], num_ps: int) -> dict[str, int]:
    """The chief: which variables to split and into how many parts, each said in its log."""
    plan = (partitioning or Partitioning()).plan([(n, np.shape(v)) for n, v in variables.items()], num_ps)
    for name, parts in plan.items():
        shape = np.shape(variables[name])
        log.info(
            "worker 0: %s (%s, %s bytes) is split into %d parts across the ps tasks: %s/part_0 to /part_%d",
            name, "x".join(map(str, shape)), f"{4 * int(np.prod(shape)):,}", parts, name, parts - 1,
        )  # fmt: skip
    return plan


def split(value: np.ndarray, parts: int) -> list[np.ndarray]:
    """``value`` cut along axis 0 into ``parts`` (first ones a row larger), as :func:`part_rows` deals them."""
    return np.array_split(np.asarray(value), parts, axis=0)


def split_arrays(arrays: Mapping[str, np.ndarray], plan: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Whole variables by name -> the variables the shards hold, parts in place of each one of ``plan``."""
    out: dict[str, np.ndarray] = {}
    for name, value in arrays.items():
        if name in plan:
            out.update({part_name(name, i): p for i, p in enumerate(split(value, plan[name]))})
        else:
            out[name] = value
    return out


def join_arrays(arrays: Mapping[str, np.ndarray], plan: Mapping[str, int]) -> dict[str, np.ndarray]:
    """The inverse of :func:`split_arrays`: each variable of ``plan`` whole again, where its first part was."""
    out: dict[str, np.ndarray] = {}
    inside = {part_name(n, i): n for n, k in plan.items() for i in range(k)}
    for name, value in arrays.items():
        whole = inside.get(name)
        if whole is None:
            out[name] = value
        elif whole not in out:
            out[whole] = np.concatenate([arrays[part_name(whole, i)] for i in range(plan[whole])], axis=0)
    return out


def split_state(state: Checkpoint, plan: Mapping[str, int]) -> Checkpoint:
    """A checkpoint of whole variables as the shards of ``plan`` hold them (for an init or a restore)."""
    if not plan:
        return state
    return dataclasses.replace(
        state,
        variables=split_arrays(state.variables, plan),
        slots={s: split_arrays(by_name, plan) for s, by_name in state.slots.items()},
    )


class Joined:
    """The whole parameter and gradient buffers of a job's partitioned variables, and the copies to and fro."""

    def __init__(self, plan: Mapping[str, int], params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]):
        """``params``, ``grads``: the shards' named views (parts by their own names)."""
        self.plan = dict(plan)
        self._parts = {n: [part_name(n, i) for i in range(k)] for n, k in self.plan.items()}
        self._owner = {p: n for n, parts in self._parts.items() for p in parts}
        missing = sorted(p for p in self._owner if p not in params)
        if missing:
            raise PsdkError(
                f"the job spec splits variables into parts the shards do not hold ({', '.join(missing[:5])}): "
                "the shards belong to different jobs; restart every ps task"
            )
        self._part_params = {n: [params[p] for p in parts] for n, parts in self._parts.items()}
        self._part_grads = {n: [grads[p] for p in parts] for n, parts in self._parts.items()}
        try:
            self.params = self._whole(params, lambda n: np.concatenate(self._part_params[n], axis=0))
        except ValueError as exc:  # parts whose trailing dimensions differ
            raise PsdkError(f"the shards hold parts that do not make one variable: {exc}") from None
        self.grads = self._whole(grads, lambda n: np.zeros_like(self.params[n]))

    def _whole(self, named: Mapping[str, T], make: Callable[[str], T]) -> dict[str, T]:
        """``named`` with each partitioned variable's parts replaced by ``make(variable)``, where its first part was."""
        out: dict[str, T] = {}
        for name, value in named.items():
            whole = self._owner.get(name)
            if whole is None:
                out[name] = value
            elif whole not in out:
                out[whole] = make(whole)
        return out

    def gather(self) -> None:
        """The parts' fresh parameters into the whole arrays (after a pull or a push's reply)."""
        for name, parts in self._part_params.items():
            np.concatenate(parts, axis=0, out=self.params[name])

    def scatter(self) -> None:
        """The whole gradients into the parts' views in the shards' buffers (before a push)."""
        for name, parts in self._part_grads.items():
            start = 0
            for part in parts:
                np.copyto(part, self.grads[name][start : start + part.shape[0]])
                start += part.shape[0]

    def shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The shards' variable shapes with each partitioned variable whole."""
        return self._whole(shapes, lambda n: tuple(self.params[n].shape))

    def join_state(self, state: Checkpoint) -> Checkpoint:
        """A cut of the shards (parts by their names) with each partitioned variable whole, by its own name."""
        if not self.plan:
            return state
        return dataclasses.replace(
            state,
            variables=join_arrays(state.variables, self.plan),
            slots={s: join_arrays(by_name, self.plan) for s, by_name in state.slots.items()},
        )

    def part_order(self, order: list[str]) -> list[str]:
        """A creation order of whole variables as the shards' names."""
        return [p for n in order for p in self._parts.get(n, [n])]
