"""The command line's overrides, checked before Hydra runs: a typo gets a message that fixes it.

Hydra's own composition errors are correct but terse ("Could not override
'trian.steps'. To append to your config use +trian.steps=10 ...") and never
suggest the name that was meant. :class:`OverrideChecker` turns each failure
into a :class:`~psdk.errors.ConfigError` naming the key or option, the
closest valid one and, for config groups, every valid option. What needs no
composition (parsing, sweeps without ``-m``, group options) is checked
before Hydra runs; what does is explained only once Hydra's composition has
failed (:meth:`OverrideChecker.explain`), so a job whose overrides are right
pays for one composition, not two (about 0.3 s of its start-up). The tasks a
launcher starts skip the checks: it checked the overrides it passes on.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from psdk.config.ranges import RANGES
from psdk.errors import ConfigError, closest, did_you_mean

# Hydra flags that take a value, and those after which psdk leaves the checking to Hydra.
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p"}
INFO_VALUES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
HANDS_OFF = {
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
    "--shell-completion",
    "-sc",
    "--help",
    "-h",
    "--hydra-help",
    "--version",
}
PRINT_KEYS = "`python -m psdk run --cfg job` prints every key with its value"
# Names other frameworks (TensorFlow flags, PyTorch examples) use, and psdk's key: a leaf, or a dotted key.
KEY_ALIASES = {
    "learning_rate": "lr",
    "learningrate": "lr",
    "max_steps": "steps",
    "train_steps": "steps",
    "num_steps": "steps",
    "training_steps": "steps",
    "batchsize": "batch_size",
    "batch": "batch_size",
    "workers": "num_workers",
    "num_worker": "num_workers",
    "replicas": "replicas_to_aggregate",
    "data_dir": "data.dir",
    "datadir": "data.dir",
    "mnist_dir": "data.dir",
    "num_epochs": "epochs",
    "train_epochs": "epochs",
}


def group_options(conf: Path) -> dict[str, list[str]]:
    """Each config group of the tree and its options (``base_*`` left out), plugins' rules, models, workloads too."""
    from psdk.plugins.registry import installed_models, installed_rules, installed_workloads

    groups = {
        d.name: {p.stem for p in d.glob("*.yaml") if not p.stem.startswith("base_")}
        for d in sorted(conf.iterdir())
        if d.is_dir() and d.name != "hydra"
    }
    groups.setdefault("optimizer", set()).update(name for name in installed_rules() if name != "noop")
    groups.setdefault("model", set()).update(installed_models())
    groups.setdefault("workload", set()).update(installed_workloads())
    return {group: sorted(options) for group, options in groups.items()}


def split_flags(args: Sequence[str]) -> tuple[list[str], bool] | None:
    """The overrides among ``args`` and whether this is a multirun; None when Hydra should judge alone."""
    overrides: list[str] = []
    multirun = False
    skip_next = False
    for i, arg in enumerate(args):
        if skip_next:
            skip_next = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in HANDS_OFF:
            return None
        if arg in ("-m", "--multirun"):
            multirun = True
        elif flag in FLAGS_WITH_VALUE:
            skip_next = "=" not in arg
        elif flag in ("--info", "-i"):
            skip_next = "=" not in arg and i + 1 < len(args) and args[i + 1] in INFO_VALUES
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides, multirun


def leaf_keys(node: Any, prefix: str = "") -> Iterator[str]:
    """Every dotted key of a config, nodes and leaves."""
    if isinstance(node, DictConfig):
        for key in node:
            path = f"{prefix}{key}"
            yield path
            yield from leaf_keys(node._get_node(key), f"{path}.")
    elif isinstance(node, ListConfig):
        return


def hydra_order(args: Sequence[str]) -> list[str]:
    """``args`` with the overrides before the flags: Hydra's parser takes no override after ``--cfg job``."""
    split = split_flags(args)
    if split is None:
        return list(args)
    overrides = split[0]
    rest = list(args)
    for override in overrides:
        rest.remove(override)
    return [*overrides, *rest]


def _alias(key: str, known: Sequence[str]) -> str | None:
    """psdk's key for a name from another framework (``optimizer.learning_rate``: ``optimizer.lr``)."""
    head, _, last = key.rpartition(".")
    alias = KEY_ALIASES.get(last.lower())
    if alias is None:
        return None
    for candidate in (f"{head}.{alias}" if head else alias, alias):
        if candidate in known:
            return candidate
    same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == alias]
    return same_leaf[0] if len(same_leaf) == 1 else None


def meant_key(key: str, known: Sequence[str]) -> str | None:
    """The key of ``known`` that ``key`` most likely means: itself, psdk's name for another framework's, a dotted
    key with the same last part (``steps``: ``train.steps``), or the closest; None when none is close."""
    if key in known:
        return key
    if (alias := _alias(key, known)) is not None:
        return alias
    last = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == last and k != key]
    if len(same_leaf) == 1:
        return same_leaf[0]
    return closest(key, known)


def suggest_key(key: str, known: Sequence[str]) -> str:
    """``; did you mean train.steps?`` for ``trian.steps``, ``train.stpes``, ``max_steps`` or a bare ``steps``."""
    meant = meant_key(key, known)
    return f"; did you mean {meant}?" if meant is not None and meant != key else ""


def tf1_flag_override(text: str) -> ConfigError | None:
    """An override named after a boolean TF1 flag (``sync_replicas=true``), refused naming the psdk override."""
    from psdk.config.flags import BOOL_FLAGS, bool_override

    key, _, value = text.partition("=")
    flag = key.lstrip("+~")
    if flag not in BOOL_FLAGS:
        return None
    when_true, when_false = BOOL_FLAGS[flag]
    try:
        meant = bool_override(flag, value or "true")
    except ConfigError:
        meant = f"{when_true} (true) or {when_false} (false)"
    return ConfigError(flag, f"there is no such key; did you mean {meant}? ({PRINT_KEYS})")


class OverrideChecker:
    """Composes ``config`` with a list of overrides and explains what fails."""

    def __init__(self, conf: Path, config_name: str = "config"):
        self.conf = conf
        self.config_name = config_name
        self.groups = group_options(conf)

    def check(self, args: Sequence[str], compose: bool = True) -> None:
        """Raise a :class:`ConfigError` for the first override that is wrong; ``compose=False``: the cheap checks."""
        from hydra.core.global_hydra import GlobalHydra

        if GlobalHydra.instance().is_initialized():
            return  # a Hydra already running in this process: Hydra judges
        plan = self._plan(args)
        if compose and plan is not None and plan[0]:  # nothing overridden: the shipped config composes (tests say so)
            self._compose(*plan)

    def composed(self, args: Sequence[str]) -> DictConfig:
        """The config composed with ``args``, checked as :meth:`check` checks them: one composition."""
        overrides, group_choices = self._plan(args) or (list(args), [])
        return self._compose(overrides, group_choices)

    def keys(self) -> list[str]:
        """Every dotted key of the config composed with no overrides, and the config groups."""
        return [k for k in leaf_keys(self._compose([], [])) if not k.startswith("hydra")] + list(self.groups)

    def explain(self, args: Sequence[str]) -> ConfigError | None:
        """Why Hydra could not compose the config with ``args``, in psdk's words; None if psdk finds no fault.

        Called after Hydra's own composition failed: psdk composes again
        (with the overrides it checks: not ``hydra.*`` ones) to name the key.
        """
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()  # the failed run's: composing again needs a fresh one
        try:
            plan = self._plan(args)
            if plan is not None and plan[0]:
                self._compose(*plan)
        except ConfigError as exc:
            return exc
        return None

    def _plan(self, args: Sequence[str]) -> tuple[list[str], list[str]] | None:
        """The checks without composition; the overrides to compose, and those choosing groups (None: Hydra's)."""
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import HydraException

        split = split_flags(args)
        if split is None:
            return None  # a custom config: Hydra judges
        texts, multirun = split
        parser = OverridesParser.create()
        composed: list[str] = []
        group_choices: list[str] = []
        given: set[str] = set()
        for text in texts:
            if (refused := tf1_flag_override(text)) is not None:
                raise refused
            try:
                override = parser.parse_override(text)
            except HydraException as exc:  # OverrideParseException, or a bare one from the grammar
                raise ConfigError(
                    text.split("=", 1)[0].lstrip("+~"),
                    f"{text!r} cannot be parsed ({str(exc).splitlines()[0]}); check brackets and quotes: "
                    "a list is key=[a,b], a value with commas or spaces is quoted, key='a,b'",
                ) from None
            key = override.key_or_group
            if key.startswith("hydra") or override.is_delete():
                continue
            values = list(override.sweep_string_iterator()) if override.is_sweep_override() else None
            if values is not None and not multirun:
                raise ConfigError(
                    key,
                    f"{text!r} gives several values; add -m to run one job per value "
                    f"(python -m psdk run -m {text}), or write {key}=[a,b] for one value that is a list",
                )
            if key in self.groups:
                for value in values or [override.value()]:
                    self._check_option(key, value)
            if values is not None or str(override.value()) not in ("null", "None"):
                given.add(key.lstrip("+"))
            single = text if values is None else f"{text.split('=', 1)[0]}={values[0]}"
            composed.append(single)
            if key in self.groups:
                group_choices.append(single)
        if {"train.steps", "train.epochs"} <= given:
            raise ConfigError(
                "train.epochs",
                "and train.steps are both given, but train.epochs sets the step count (docs/configuration.md#epochs): "
                "give one of them",
            )
        return composed, group_choices

    def _check_option(self, group: str, value: object) -> None:
        if value is None or str(value) == "null":
            return
        options = self.groups[group]
        if str(value) not in options:
            hint = did_you_mean(str(value), options, f"{group}={{}}")
            raise ConfigError(group, f"has no option {str(value)!r}{hint}", options)

    def _compose(self, overrides: list[str], group_choices: list[str]) -> DictConfig:
        from hydra import compose, initialize_config_dir
        from hydra.errors import ConfigCompositionException, MissingConfigException

        with initialize_config_dir(config_dir=str(self.conf), version_base="1.3"):
            try:
                return compose(self.config_name, overrides=overrides)
            except MissingConfigException as exc:
                group, _, choice = (exc.missing_cfg_file or "").rpartition("/")
                options = [o for o in exc.options or [] if not o.startswith("base_")]
                hint = did_you_mean(choice, options, f"{group}={{}}")
                raise ConfigError(group or "config", f"has no option {choice!r}{hint}", options) from None
            except ConfigCompositionException as exc:
                try:
                    base = compose(self.config_name, overrides=group_choices)
                except ConfigCompositionException:  # a group choice itself fails: explain against the defaults
                    base = compose(self.config_name)
                raise self._explain(exc, base) from None

    def _explain(self, exc: Exception, base: DictConfig) -> ConfigError:
        from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

        cause = exc.__cause__
        found = re.search(r"override '([^']+)'|merging override ([^=\s]+)", str(exc))
        key = (found.group(1) or found.group(2)) if found else getattr(cause, "full_key", None) or "config"
        key = key.lstrip("+~")
        if (twice := re.search(r"Multiple values for (\S+?)\.", str(exc))) is not None:
            group = twice.group(1)
            return ConfigError(group, f"is chosen by default already; drop the + and write {group}=<option>")
        if isinstance(cause, ValidationError):
            wanted = re.search(r"converted to (\w+)|not a valid (bool)", str(cause))
            kind = {"Integer": "a whole number", "Float": "a number", "bool": "true or false"}.get(
                (wanted.group(1) or wanted.group(2)) if wanted else "", "of the right type"
            )
            limits = RANGES.get(key)
            if limits is not None and kind in ("a whole number", "a number"):
                kind = limits.describe()  # the key's valid range (psdk.config.ranges), not only its type
            value = re.search(r"Value '([^']*)'", str(cause))
            default = OmegaConf.select(base, key, default=None)
            shown = str(default).lower() if isinstance(default, bool) else default
            example = f"; e.g. {key}={shown}" if default is not None else ""
            got = f"{value.group(1)!r}" if value else "the value given"
            return ConfigError(key, f"must be {kind}, got {got}{example}")
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) or "No match" in str(exc):
            known = [k for k in leaf_keys(base) if not k.startswith("hydra")] + list(self.groups)
            group_hint = ""
            head = key.split(".", 1)[0]
            if head not in self.groups and (match := closest(head, self.groups)) is not None and "." not in key:
                group_hint = f"; did you mean the config group {match}= (options: {', '.join(self.groups[match])})?"
            hint = group_hint or suggest_key(key, known)
            return ConfigError(key, f"there is no such key{hint} ({PRINT_KEYS})")
        detail = f": {str(cause).splitlines()[0]}" if cause is not None else ""
        return ConfigError(key, f"{str(exc).splitlines()[0]}{detail}")
