"""What the chief tells every ps shard about the job when it initialises the store."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from psdk.errors import ConfigError, ProtocolError
from psdk.protocol.partitions import check_plan
from psdk.ps.consistency import SyncSpec

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""What a run id may be: it is part of checkpoint file names."""


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id):
        raise ConfigError(
            "run_id",
            f"{run_id!r} is not a run id: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    return run_id


@dataclass(frozen=True)
class JobSpec:
    """What the chief tells every shard when it initialises the store."""

    sync: SyncSpec
    steps: int
    num_workers: int
    run_id: str | None = None
    """The run this job is (its checkpoints carry it); a restarted chief takes it from the shards."""
    partitions: dict[str, int] = field(default_factory=dict)
    """The variables split across shards and their parts (:mod:`psdk.protocol.partitions`): every worker joins
    them back from this."""

    @classmethod
    def from_json(cls, data: Any) -> JobSpec:
        if not isinstance(data, dict):
            raise ProtocolError("job spec is not an object")
        try:
            sync = SyncSpec(**data["sync"])
            steps, workers = int(data["steps"]), int(data["num_workers"])
            run_id = data.get("run_id")
            if run_id is not None and not isinstance(run_id, str):
                raise TypeError(f"run_id is {run_id!r}, not a string")
            if run_id is not None:
                check_run_id(run_id)
            partitions = check_plan(data.get("partitions", {}))
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise ProtocolError(f"bad job spec: {exc}") from None
        if steps < 1 or workers < 1:
            raise ProtocolError("job spec needs steps >= 1 and num_workers >= 1")
        try:
            return cls(sync.resolved(workers), steps, workers, run_id, partitions)
        except ConfigError as exc:
            raise ProtocolError(str(exc)) from None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "sync": self.sync.to_json(),
            "steps": self.steps,
            "num_workers": self.num_workers,
            "run_id": self.run_id,
        }
        if self.partitions:  # a job without partitions says what it said before
            data["partitions"] = dict(self.partitions)
        return data
