"""Every error psdk raises on purpose, rooted at :class:`PsdkError`.

Each subclass carries the data that explains it, and its message says what
was wrong and how to fix it: a user should never need a traceback to act.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

# The exit code of a task refused for its configuration or data: running it again cannot help.
USAGE_EXIT = 2

# The plugins in psdk's own repository, for a user who has not installed them: how to, and what
# else people call them. An installed plugin's own record (aliases, install) says this for itself.
REPOSITORY_PLUGINS = {
    "torch": ("pip install -e plugins/torch_backend (the psdk-torch plugin; install the torch build you want first)",
              ("pytorch",)),
    "tf": ("pip install -e 'plugins/tf_backend[cpu]' (the psdk-tf plugin with tensorflow-cpu; [gpu] for CUDA)",
           ("tensorflow", "tensorflow2", "keras")),
    "jax": ("pip install -e plugins/jax_backend (the psdk-jax plugin; jax and optax, CPU; see JAX's docs for CUDA)",
            ("flax", "optax")),
}  # fmt: skip


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The choice ``name`` was most likely meant to be (a typo), or None when none is close."""
    options = [str(c) for c in choices]
    lowered = {c.lower(): c for c in options}
    if name.lower() in lowered:
        return lowered[name.lower()]
    found = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(name: str, choices: Iterable[str], template: str = "{}") -> str:
    """``"; did you mean X?"`` when a choice is close to ``name``, else nothing."""
    match = closest(name, choices)
    return f"; did you mean {template.format(match)}?" if match is not None and match != name else ""


class PsdkError(Exception):
    """Root of psdk's own errors; the CLI prints these without a traceback."""


class ConfigError(PsdkError):
    """A configuration value is invalid; names the key and the valid choices."""

    def __init__(self, key: str, problem: str, choices: Iterable[str] | None = None) -> None:
        self.key = key
        self.problem = problem
        self.choices = sorted(choices) if choices is not None else None
        message = f"{key}: {problem}"
        if self.choices is not None:
            message += f" (valid choices: {', '.join(self.choices) or 'none installed'})"
        super().__init__(message)


class UnknownBackendError(ConfigError):
    """``backend=`` names no installed plugin."""

    def __init__(
        self, name: str, installed: Iterable[str], aliases: Mapping[str, str] | None = None, broken: Iterable[str] = ()
    ) -> None:
        """``aliases``: other names of the installed backends (from their records), to the backend's name;
        ``broken``: why plugins that failed to load did (the backend may be in one of them)."""
        names = sorted(installed)
        known = {alias: real for real, (_, others) in REPOSITORY_PLUGINS.items() for alias in others}
        known.update(aliases or {})
        guess = closest(name, [*names, *REPOSITORY_PLUGINS, *known])
        meant = known.get(name.lower()) or known.get(guess or "", guess)
        if meant is None:
            advice = (
                f"psdk has no {name} backend in this environment. Pick an installed one (backend=<name> below; "
                "`python -m psdk plugins` lists them), install a plugin that provides it, or write one "
                "(docs/writing-a-backend.md)"
            )
        elif meant in names:
            advice = f"did you mean backend={meant}?"
        else:
            missing = f"plugin is not installed in this environment: {REPOSITORY_PLUGINS[meant][0]}"
            advice = f"did you mean backend={meant}? Its {missing}" if meant != name else f"its {missing}"
        notes = "".join(f"; note: {why}" for why in broken)
        super().__init__("backend", f"no installed backend is called {name!r}; {advice}{notes}", names)
        self.name = name


class PluginError(PsdkError):
    """A plugin misbehaves: duplicate names, a broken entry point, a bad record."""


class PortInUseError(PsdkError):
    """A ps task could not bind its address."""

    def __init__(self, address: str, task: str) -> None:
        self.address = address
        self.task = task
        super().__init__(
            f"{task} cannot bind {address}: the port is in use (another ps still running, or another program). "
            "Pick another port in ps_hosts, and give the workers the same ps_hosts, or stop the process "
            f"holding it (`ss -ltnp | grep :{address.rpartition(':')[2]}` shows it)."
        )


class BindError(PsdkError):
    """A ps task could not bind its address (other than a busy port); says how to fix it."""

    def __init__(self, address: str, task: str, reason: str, explicit: bool) -> None:
        self.address = address
        self.task = task
        self.reason = reason
        advice = (
            "ps.bind must be an address of this host"
            if explicit
            else "a ps binds its own ps_hosts entry unless told otherwise, and that entry is not an "
            "address of this host (a Kubernetes service name, a load balancer or a NAT address "
            "reaches the ps but cannot be bound). Set ps.bind to what this host can bind"
        )
        super().__init__(
            f"{task} cannot bind {address} ({reason}): {advice}, e.g. "
            "ps.bind=eth0 (an interface; the port comes from ps_hosts), ps.bind='${oc.env:POD_IP}' "
            "(the pod's IP from the downward API) or ps.bind=0.0.0.0 (every interface, only if you mean it)."
        )


class DataError(PsdkError):
    """A workload's data set is missing, corrupt, could not be downloaded, or is not what the workload reads."""


class ProtocolError(PsdkError):
    """A message off the wire is malformed; it is rejected, never half-applied.

    Malformed is what the message alone shows: it cannot be decoded or sent
    (the wire's limits), or an op is unknown, or a field is missing or of the
    wrong type, or its arrays do not match its own fields. A well-formed
    request the ps will not carry out is a :class:`RefusedError`.
    """


class RefusedError(PsdkError):
    """A well-formed request the ps refuses, by its state, its job or its rules: nothing changed.

    ``kind`` is the error kind its reply carries (:data:`psdk.protocol.ERROR_KINDS`),
    so that a worker tells refusals apart by kind, never by their text. Not a
    :class:`ProtocolError`: nothing was malformed, and only the ps's own
    modules raise it (a worker sees a refusal as :class:`RemoteError`).
    """

    kind = "rejected"

    def __init__(self, message: str, kind: str | None = None) -> None:
        if kind is not None:
            self.kind = kind
        super().__init__(message)


class NonFiniteError(RefusedError):
    """An update would leave the store holding NaN or Inf: refused, and the store is as it was."""

    kind = "non_finite"


class TransportError(PsdkError):
    """A request could not be completed, or an address bound; names the peer or the address."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        self.reason = reason
        """What the system said, alone (a bind's "No such device"), when the transport knows it."""
        super().__init__(message)


class PeerTimeoutError(TransportError):
    """No reply came from a peer before the deadline."""

    def __init__(self, peer: str, what: str, waited_s: float, cause: str | None = None) -> None:
        self.peer = peer
        self.what = what
        self.waited_s = waited_s
        self.cause = cause
        """The likely reason, when the wait could tell one (see :mod:`psdk.runtime.waits`)."""
        super().__init__(f"timed out after {waited_s:.1f} s waiting for {peer} ({what}){f'; {cause}' if cause else ''}")


class PeerDeadError(TransportError):
    """A peer stopped answering heartbeats while we waited for it."""

    def __init__(self, peer: str, what: str, silent_s: float) -> None:
        self.peer = peer
        self.what = what
        self.silent_s = silent_s
        super().__init__(
            f"{peer} stopped answering heartbeats {silent_s:.1f} s ago while waiting for {what}; "
            "it has probably died (see its log)"
        )


class PeerRestartedError(TransportError):
    """A ps answered heartbeats as a new process while a request to its old self was in flight."""

    def __init__(self, peer: str, what: str) -> None:
        self.peer = peer
        self.what = what
        super().__init__(f"{peer} restarted while waiting for {what}; the request was lost with it")


class RemoteError(PsdkError):
    """A ps task refused a request and said why; ``kind`` (:data:`psdk.protocol.ERROR_KINDS`) says what refusal."""

    def __init__(self, peer: str, message: str, kind: str = "error") -> None:
        self.peer = peer
        self.kind = kind
        self.remote_message = message
        super().__init__(f"{peer}: {message}")


class TrainingResumed(PsdkError):
    """A ps was lost after this worker's training ended, and the job was restored to a step before its end.

    Raised by :meth:`psdk.api.WorkerSession.finish`: train on until
    ``should_stop()`` and finish again. At most the steps since the run's
    last checkpoint are trained twice.
    """

    def __init__(self, global_step: int, steps: int) -> None:
        self.global_step = global_step
        super().__init__(
            f"a ps was lost after training ended and the job was restored to global step {global_step} of "
            f"{steps}: train on until should_stop(), then finish again"
        )


class CheckpointAbandoned(PsdkError):
    """The checkpoint pause ended before every shard's state was read: no consistent cut, no file.

    The ps ends a pause whose chief went silent for ``ps.pause_lease_s``
    (a stalled chief, say); the chief then skips this checkpoint and writes
    the next one when it is due.
    """


class JobFailedError(PsdkError):
    """A task of the job died or failed; names it and says how it ended."""
