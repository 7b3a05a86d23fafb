"""The commands besides running a job: ``bench``, ``fuzz``, ``keys``, ``data`` and ``plugins``.

Each takes its own ``key=value`` arguments (``bench`` and ``data`` through
Hydra's config, the others a handful of options checked here) and returns
the process's exit status; :func:`psdk.launch.cli.main` dispatches to them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

from psdk.errors import ConfigError, PsdkError
from psdk.runtime.logs import set_task_label

log = logging.getLogger("psdk")


def _bench(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from psdk.bench.ctr import run_ctr_suite
    from psdk.bench.suite import run_suite

    set_task_label("bench")
    suites = {"mnist": run_suite, "ctr": run_ctr_suite}  # the click-through workload against its own peers
    try:
        if cfg.suite not in suites:
            raise ConfigError("suite", f"must be mnist or ctr, got {cfg.suite!r}")
        suites[cfg.suite](cfg, Path(HydraConfig.get().runtime.output_dir))
    except PsdkError as exc:
        log.error("%s", exc)
        raise SystemExit(1) from None


def run_bench(args: list[str]) -> None:
    import hydra

    from psdk.config import config_dir, prepare_hydra

    prepare_hydra()
    sys.argv = ["psdk bench", *args]
    hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="bench")(_bench)()


def _options(args: Sequence[str], defaults: dict[str, str]) -> dict[str, str]:
    options = dict(defaults)
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in options:
            raise ConfigError(key, f"unknown argument {arg!r}", [f"{k}=..." for k in options])
        options[key] = value
    for key, value in options.items():
        if defaults[key].isdigit() and not value.isdigit():
            raise ConfigError(key, f"must be a whole number, got {value!r}")
    return options


def run_fuzz(args: Sequence[str]) -> int:
    """``fuzz sequences=N steps=K count=M seed=S``: the stateful stages, then single messages; exit 1 on a failure."""
    options = _options(args, {"sequences": "300", "steps": "50", "count": "100000", "seed": "0"})
    logging.basicConfig(level=logging.ERROR)
    psdk_log = logging.getLogger("psdk")
    propagate, psdk_log.propagate = psdk_log.propagate, False  # the ps under fuzz logs every refusal: not output
    try:
        return _fuzz_stages(options)
    finally:  # as it was: main() may run in a process that goes on (a test, a notebook)
        psdk_log.propagate = propagate


FUZZ_EXTRA = "pip install 'psdk[fuzz]'"
"""How to get what ``psdk fuzz`` needs beyond psdk itself (hypothesis, declared as the ``fuzz`` extra)."""


def _fuzz_stages(options: dict[str, str]) -> int:
    # psdk.fuzz is psdk's own tooling, not product code: imported here only, when the command runs.
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise ConfigError("fuzz", f"needs hypothesis, which psdk does not install by default: {FUZZ_EXTRA}") from None
    from psdk.fuzz import runner, single
    from psdk.fuzz.alongside import run_alongside
    from psdk.fuzz.harness import Mode

    seed, ok = int(options["seed"]), True
    stages = [(Mode(False, False), False), (Mode(False, True), False), (Mode(True, True), False)]
    for mode, tables in [*stages, (Mode(False, False), True)]:  # then sequences that all declare tables
        result = runner.run(mode, int(options["sequences"]), int(options["steps"]), seed=seed, tables=tables)
        print(result.line(), flush=True)
        ok = ok and result.failure is None
    alongside = run_alongside(steps=3000, seed=seed, curve=True)
    print(alongside.line(), flush=True)
    report = single.run(int(options["count"]), seed)
    print("single messages from a stranger: " + "\n".join(report.lines()))
    return 0 if ok and alongside.ok and report.ok else 1


def make_keys(args: Sequence[str]) -> int:
    """``keys keys_dir=DIR workers=N ps=M [overwrite=true]``: a keypair per ps task and per worker."""
    from psdk.transport import security

    options = _options(args, {"keys_dir": "keys", "workers": "2", "ps": "1", "overwrite": "false"})
    for key in ("workers", "ps"):
        if int(options[key]) < 1:
            raise ConfigError(key, f"must be at least 1, got {options[key]!r}")
    if options["overwrite"] not in ("true", "false"):
        raise ConfigError("overwrite", f"must be true or false, got {options['overwrite']!r}")
    folder = Path(options["keys_dir"])
    security.generate(folder, int(options["workers"]), int(options["ps"]), overwrite=options["overwrite"] == "true")
    print(f"keys for {options['ps']} ps task(s) and {options['workers']} workers in {folder}/:")
    print(f"  ps task j needs   {folder}/ps/ps-<j>.key_secret and {folder}/workers/*.key")
    print(f"  worker i needs    {folder}/workers/worker-<i>.key_secret and {folder}/ps/*.key")
    print(f"  give every task   transport.keys_dir={folder} (a folder holding those files, on its own host)")
    return 0


def check_data(args: Sequence[str]) -> int:
    """``data [data.dir=...] [workload=...]``: the workload's data found (or downloaded) and checked; no training."""
    from psdk.config import config_dir, prepare_hydra
    from psdk.config.check import OverrideChecker
    from psdk.plugins.loading import run_entry, workload_of

    prepare_hydra()
    cfg = OverrideChecker(config_dir()).composed(args)
    code = run_entry(cfg, "data")
    if code is None:
        print(f"the workload {workload_of(cfg).name!r} has no data to check")
        return 0
    return int(code)


def list_plugins() -> int:
    """Every kind of thing plugins add, psdk's own built-ins among them, with who provides each."""
    from psdk.plugins.loading import listing

    print(f"{'kind':<8} {'name':<10} {'provided by':<28} description")
    for kind, name, provider, description in listing():
        print(f"{kind:<8} {name:<10} {provider:<28} {description}")
    return 0


def export(args: Sequence[str]) -> int:
    """``export CHECKPOINT [OUT] [table=NAME]``: a checkpoint's tables as ids.npy and rows.npy per table."""
    places = [a for a in args if "=" not in a]
    options = _options([a for a in args if "=" in a], {"table": ""})
    if not 1 <= len(places) <= 2:
        raise ConfigError("export", "usage: python -m psdk export CHECKPOINT [OUT] [table=NAME]")
    from psdk.client.export import export_tables

    out = Path(places[1]) if len(places) == 2 else Path(places[0]).with_suffix("")
    names = [options["table"]] if options["table"] else None
    for name, count in export_tables(Path(places[0]), out, names).items():
        print(f"{name}: {count} rows -> {out / name}/ids.npy, rows.npy")
    return 0


def run_command(command: str, args: list[str]) -> int:
    """Run ``command`` (one of this module's) with its arguments; its exit status."""
    if command == "plugins":
        return list_plugins()
    if command == "fuzz":
        return run_fuzz(args)
    if command == "keys":
        return make_keys(args)
    if command == "data":
        return check_data(args)
    if command == "export":
        return export(args)
    run_bench(args)
    return 0
