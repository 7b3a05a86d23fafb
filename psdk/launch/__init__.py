"""Launchers: how the tasks of a job get started."""

LAUNCHED_ENV = "PSDK_LAUNCHED"
"""Set in every task a launcher starts: the launcher checked the overrides it passes on."""

HANDOFF_ENV = "PSDK_TASK_CONFIG"
"""Set in a task a local launcher starts: where its config is, composed already (:mod:`psdk.launch.handoff`)."""
