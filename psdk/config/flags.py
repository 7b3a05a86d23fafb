"""TensorFlow 1.x's ``--flags``, read as the overrides they mean; any other ``--flag`` gets a did-you-mean.

A TF1 ps/worker script takes the four cluster flags (``--job_name``,
``--task_index``, ``--ps_hosts``, ``--worker_hosts``) and, most often, a few
training ones: ``--batch_size``, ``--learning_rate``, ``--train_steps``,
``--sync_replicas``, ``--replicas_to_aggregate``, ``--data_dir``. psdk takes
each as the override it means (``--learning_rate=0.01`` is
``optimizer.lr=0.01``), so a TF1 command line runs unchanged. Hydra's own
flags (``--cfg``, ``--multirun``, ...) pass through. Any other ``--flag`` is
refused in one line naming what was probably meant: a flag (``--task_idx``:
``--task_index``), the psdk key of a TF1 flag with no one-to-one meaning
(``--num_epochs``: ``train.epochs``), or the override a config key would be
(``--seed=3``: ``seed=3``), found as for a mistyped override
(:func:`psdk.config.check.meant_key`). Argparse's bare usage text said none
of this.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from psdk.errors import ConfigError, closest

CLUSTER_FLAGS = ("job_name", "task_index", "ps_hosts", "worker_hosts")
# TF1 training flags with one psdk key each.
TRAINING_FLAGS = {
    "batch_size": "train.batch_size",
    "learning_rate": "optimizer.lr",
    "train_steps": "train.steps",
    "max_steps": "train.steps",
    "replicas_to_aggregate": "sync.replicas_to_aggregate",
    "data_dir": "data.dir",
}
# Boolean TF1 flags: the override for true, and for false (``--nosync_replicas`` too, as TF1's flags take it).
BOOL_FLAGS = {"sync_replicas": ("sync=sync", "sync=async")}
# TF1 flags whose meaning psdk says another way: refused, naming the psdk key and how it differs.
SAID_OTHERWISE = {
    "num_epochs": "psdk's epochs count passes over the training set by the job as a whole (docs/configuration.md"
    "#epochs): a TF1 program whose every worker loops N times over it is train.epochs=<N x workers>",
    "train_dir": "psdk writes checkpoints and summaries into the run's folder: choose it with hydra.run.dir=DIR "
    "(checkpoint.dir=DIR for the checkpoints alone)",
    "hidden_units": "give the hidden layers' sizes as model.hidden=[100] (model=softmax for none)",
}
SAID_OTHERWISE["epochs"] = SAID_OTHERWISE["train_epochs"] = SAID_OTHERWISE["num_epochs"]
SAID_OTHERWISE["log_dir"] = SAID_OTHERWISE["logdir"] = SAID_OTHERWISE["train_dir"]
# Hydra's long flags, left to Hydra.
HYDRA_FLAGS = (
    "help", "hydra-help", "version", "cfg", "resolve", "package", "run", "multirun", "shell-completion",
    "config-path", "config-name", "config-dir", "experimental-rerun", "info",
)  # fmt: skip
TF1_FLAGS = (*CLUSTER_FLAGS, *TRAINING_FLAGS, *BOOL_FLAGS)
TRUE, FALSE = ("true", "1", "yes", "y", "on"), ("false", "0", "no", "n", "off")
FLAG = re.compile(r"--([\w.\-]+)(?:=(.*))?", re.DOTALL)


def bool_override(flag: str, value: str) -> str:
    """The override a boolean TF1 flag means with ``value`` (``--sync_replicas=true``: ``sync=sync``)."""
    when_true, when_false = BOOL_FLAGS[flag]
    if value.strip().lower() in TRUE:
        return when_true
    if value.strip().lower() in FALSE:
        return when_false
    raise ConfigError(
        f"--{flag}", f"takes true or false, got {value!r}: --{flag}=true is {when_true}, --{flag}=false {when_false}"
    )


def translate(args: Sequence[str], meant_key: Callable[[str], str | None] | None = None) -> list[str]:
    """``args`` with every TF1 ``--flag`` turned into its override; a ``--flag`` psdk does not take is refused.

    ``meant_key``: the config key a name most likely means, asked only to
    explain a flag that is neither a flag nor near one (``--seed=3``: did
    you mean ``seed=3``?).
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        match = FLAG.fullmatch(arg)
        if match is None or match.group(1) in HYDRA_FLAGS:
            out.append(arg)
            i += 1
            continue
        flag, value = match.group(1), match.group(2)
        negated = flag.startswith("no") and flag[2:] in BOOL_FLAGS
        if flag in BOOL_FLAGS or negated:
            if value is None and not negated and i + 1 < len(args) and args[i + 1].lower() in (*TRUE, *FALSE):
                value = args[i + 1]  # `--sync_replicas true`
                i += 1
            out.append(bool_override(flag[2:], "false") if negated else bool_override(flag, value or "true"))
            i += 1
            continue
        if flag not in CLUSTER_FLAGS and flag not in TRAINING_FLAGS:
            raise unknown_flag(flag, value, meant_key)
        if value is None:
            if i + 1 >= len(args):
                raise ConfigError(f"--{flag}", f"--{flag} needs a value, e.g. --{flag}=<value>")
            value = args[i + 1]
            i += 1
        out.append(f"{TRAINING_FLAGS.get(flag, flag)}={value}")
        i += 1
    return out


def unknown_flag(flag: str, value: str | None, meant_key: Callable[[str], str | None] | None) -> ConfigError:
    """Why ``--flag`` is refused, with what was probably meant."""
    name = f"--{flag}"
    said = SAID_OTHERWISE.get(flag.lower().replace("-", "_"))
    if said is not None:
        return ConfigError(name, f"psdk takes no such flag; {said}")
    meant = closest(flag, [*TF1_FLAGS, *HYDRA_FLAGS, *SAID_OTHERWISE])
    if meant is not None:
        return ConfigError(name, f"psdk takes no such flag; did you mean --{meant}?")
    given = value if value is not None else "<value>"
    key = meant_key(flag) if meant_key is not None else None
    if key is not None:
        return ConfigError(
            name, f"psdk takes no such flag; settings are key=value overrides: did you mean {key}={given}?"
        )
    return ConfigError(
        name,
        f"psdk takes no such flag (it takes TensorFlow 1.x's --{', --'.join(TF1_FLAGS)}, and Hydra's); "
        f"settings are key=value overrides without dashes ({flag}={given} if that is a key: "
        "`python -m psdk run --cfg job` prints every key)",
    )
