"""Launchers: how the tasks of a job get started."""
