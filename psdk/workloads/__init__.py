"""The workloads bundled with psdk, each a package registered through ``psdk_register_workloads`` as a plugin's is.

A workload is the job around the parameter server: its data, models,
training loop and evaluation (:class:`psdk.plugins.hookspecs.WorkloadRecord`).
The CLI and the launchers find the chosen one through the registry and never
import a workload's package themselves (``tests/test_workloads.py``).
"""
