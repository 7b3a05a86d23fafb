"""The Hydra callback that ends a multirun with a comparison of its runs.

Registered in ``conf/config.yaml`` (``hydra.callbacks``), so every sweep of
``python -m psdk run -m ...`` writes ``comparison.md``, ``comparison.csv`` and
``comparison.png`` into its folder once its last run is done. Hydra builds
callbacks for single runs and for every task too; this one does nothing
until ``on_multirun_end``, and imports nothing heavy before that.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class ComparisonCallback(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from psdk.report.compare import markdown, target_for, write_comparison

        root = Path(str(config.hydra.sweep.dir)).resolve()
        report = config.get("report") or {}
        try:
            target = target_for(root, report)  # report.target, for the workload's primary metric
            rows = write_comparison(root, target, plot=bool(report.get("plot", True)))
        except Exception as exc:  # the runs are done and saved: a report that fails must not hide them
            log.error(
                "comparison of the runs in %s failed: %s (rebuild it with `python -m psdk report %s`)", root, exc, root
            )
            return
        print(markdown(rows, target, f"{len(rows)} runs, comparison in {root}/comparison.md"), flush=True)
