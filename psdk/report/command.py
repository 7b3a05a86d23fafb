"""``python -m psdk report PATH``: rebuild what a run or a sweep shows, from its folder.

PATH a run's folder: ``curves.png`` is (re)drawn and its figures printed.
PATH any other folder (a multirun's, or one holding several runs): the
comparison of every run below it is (re)written, as the multirun's callback
writes it. Neither needs the run to have finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from psdk.errors import ConfigError
from psdk.report.compare import markdown, row, target_for, write_comparison
from psdk.report.runs import find_runs, is_run, load_run

USAGE = "usage: python -m psdk report PATH [target=0.97] [plot=true|false]"


def _given_target(options: dict[str, str]) -> dict[str, float]:
    """``target=`` (or ``target_<metric>=``, as ``target_accuracy=`` for MNIST) as numbers."""
    given = {}
    for key, value in options.items():
        if key == "target" or key.startswith("target_"):
            try:
                given[key] = float(value)
            except ValueError:
                raise ConfigError(key, f"must be a number, got {value!r}") from None
    return given


def report(args: Sequence[str]) -> int:
    paths = [a for a in args if "=" not in a]
    options = dict(a.split("=", 1) for a in args if "=" in a)
    unknown = sorted(k for k in options if k != "plot" and k != "target" and not k.startswith("target_"))
    if len(paths) != 1 or unknown:
        raise ConfigError(
            unknown[0] if unknown else "PATH",
            USAGE + (f"; unknown option {unknown[0]!r}" if unknown else ""),
        )
    folder = Path(paths[0]).resolve()
    if not folder.is_dir():
        raise ConfigError("PATH", f"{folder} is not a folder (a run's, or a multirun's)")
    target = target_for(folder, _given_target(options))
    plot = options.get("plot", "true").lower() not in ("false", "0", "no")
    if is_run(folder):
        run = load_run(folder)
        if plot:
            from psdk.report.plot import plot_curves

            print(f"training curves: {plot_curves(run, folder / 'curves.png')}")
        print(markdown([row(run, folder, target)], target, run.title()), end="")
        if run.summary is not None:
            from psdk.report.metrics import summary_line

            print(summary_line(run.summary))
        return 0
    if not find_runs(folder):
        raise ConfigError("PATH", f"no runs in {folder} (a run's folder has summary.json, tasks/ or .hydra/)")
    rows = write_comparison(folder, target, plot=plot)
    print(markdown(rows, target, f"{len(rows)} runs in {folder}"), end="")
    written = ["comparison.md", "comparison.csv", *(["comparison.png"] if plot else [])]
    print(f"written: {', '.join(str(folder / name) for name in written)}")
    return 0 if all(r["finished"] for r in rows) else 1
