"""Log records that say which task wrote them (``worker 1``, ``ps 0``, ``launcher``)."""

from __future__ import annotations

import logging

_task_label = "psdk"


def set_task_label(label: str) -> None:
    global _task_label
    _task_label = label


def task_label() -> str:
    return _task_label


class TaskFilter(logging.Filter):
    """Adds ``%(task)s`` to every record; referenced from conf/hydra/job_logging/psdk.yaml."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.task = _task_label
        return True
