"""Launchers: how the tasks of a job get started."""

LAUNCHED_ENV = "PSDK_LAUNCHED"
"""Set in every task a launcher starts: the launcher checked the overrides it passes on."""
