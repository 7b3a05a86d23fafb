"""The stateful fuzzer's reference model: what one ps shard should hold, restated in plain numpy.

Checking replies, finiteness and liveness cannot see a lost update, a
doubled one, a wrong sign or a wrong learning rate: a ps that replaced every
second gradient with zeros passed. So the fuzzer keeps its own copy of the
shard (parameters, slots, rule step, version) and applies to it what the ps
should have applied, with each update rule's formulas written out again
here in float64 (:class:`RuleModel`), not by calling :mod:`psdk.ps.rules`; the
sync round (the mean of ``replicas_to_aggregate`` gradients, stale and
second gradients dropped), the checkpoint pause (pushes held, then applied
in order), the target step, restores and refusals of updates that would
overflow float32 are modelled too. After every step, and against every
checkpoint's state, :meth:`Model.compare` lists where the ps differs, within
float tolerance.

The model follows the ps as the fuzzer observes it, as a Jepsen checker
does: what a request did is read from its reply (a refused request changes
nothing, a restore answered ``ok`` resets the model), and the harness sends
one request at a time and waits until the ps has handled it, so the order
in which the ps applied gradients is the order they were sent in (held ones
in the order they were held), and the version a reply carries must be the
model's. Where the ps's word decides (a refusal, a restore), the model
checks what it can: a refusal for overflow must be one the model's own
arithmetic overflows on too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psdk.fuzz.rows import RowRequest, TableModel, TableState
from psdk.ps.consistency import POLICIES

F32_MAX = float(np.finfo(np.float32).max)
RTOL, ATOL = 1e-4, 1e-6
"""Float tolerance of the comparison: the ps computes in float32, the model in float64."""
ROUNDING = 2.0**-20
"""What float32 may lose on one update, relative to the largest magnitude the update handled (a few roundings
of 2^-24 each). A value that passed 3e37 and came back near zero carries float32's error of 3e37 with it, so the
comparison's absolute tolerance grows by this much of each update's largest value (see Model.slack)."""


class RuleModel:
    """One update rule's arithmetic, from its JSON (as the chief sends it), as formulas on float64 arrays.

    Every step returns new arrays: a refused update leaves the old ones.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = dict(spec)
        self.name = str(spec.get("name", "sgd"))
        if self.name not in ("sgd", "adam", "adagrad", "rmsprop", "noop"):
            raise ValueError(f"the fuzzer's model knows no update rule {self.name!r}")

    def _get(self, key: str, default: Any) -> Any:
        return self.spec.get(key, default)

    def slot_names(self) -> tuple[str, ...]:
        if self.name == "sgd":
            return ("momentum",) if self._get("momentum", 0.0) else ()
        if self.name == "adam":
            return ("m", "v")
        if self.name == "adagrad":
            return ("sum",)
        if self.name == "rmsprop":
            names = ["square_avg"]
            if self._get("momentum", 0.0):
                names.append("momentum")
            if self._get("centered", False):
                names.append("grad_avg")
            return tuple(names)
        return ()

    def initial_slots(self, size: int) -> dict[str, np.ndarray]:
        fill = float(self._get("initial_accumulator_value", 0.0)) if self.name == "adagrad" else 0.0
        return {name: np.full(size, fill, np.float64) for name in self.slot_names()}

    def lr(self, step: int) -> float:
        warmup = int(self._get("warmup_steps", 0))
        return self._decayed(step) * (min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)

    def _decayed(self, step: int) -> float:
        lr, rate, steps = (
            float(self._get("lr", 0.01)),
            float(self._get("decay_rate", 1.0)),
            self._get("decay_steps", 1000),
        )
        if rate == 1.0:
            return lr
        if self._get("decay", "exponential") == "cosine":
            done = min(step, steps) / steps
            return lr * (rate + (1 - rate) * 0.5 * (1 + math.cos(math.pi * done)))
        return float(lr * rate ** (step / steps))

    def step(
        self, p: np.ndarray, g: np.ndarray, slots: dict[str, np.ndarray], t: int
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Parameters and slots after the update that follows ``t`` earlier ones."""
        lr, new = self.lr(t), dict(slots)
        g = g + float(self._get("weight_decay", 0.0)) * p
        if self.name == "noop":
            return p, new
        if self.name == "sgd":
            mu = float(self._get("momentum", 0.0))
            d = g
            if mu:
                buf = g if t == 0 else mu * slots["momentum"] + g
                new["momentum"] = buf
                d = mu * buf + g if self._get("nesterov", False) else buf
            return p - lr * d, new
        if self.name == "adam":
            b1, b2, eps = (
                float(self._get("beta1", 0.9)),
                float(self._get("beta2", 0.999)),
                float(self._get("eps", 1e-8)),
            )
            m = b1 * slots["m"] + (1 - b1) * g
            v = b2 * slots["v"] + (1 - b2) * g * g
            new["m"], new["v"] = m, v
            c1, c2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)
            if self._get("epsilon_mode", "torch") == "torch":
                return p - lr / c1 * m / (np.sqrt(v) / math.sqrt(c2) + eps), new
            return p - lr * math.sqrt(c2) / c1 * m / (np.sqrt(v) + eps), new
        if self.name == "adagrad":
            total = slots["sum"] + g * g
            new["sum"] = total
            return p - lr * g / (np.sqrt(total) + float(self._get("eps", 1e-10))), new
        alpha, eps, mu = float(self._get("alpha", 0.99)), float(self._get("eps", 1e-8)), float(self._get("momentum", 0))
        square = alpha * slots["square_avg"] + (1 - alpha) * g * g
        new["square_avg"] = square
        if self._get("centered", False):
            avg = alpha * slots["grad_avg"] + (1 - alpha) * g
            new["grad_avg"] = avg
            denom = np.sqrt(square - avg * avg) + eps
        else:
            denom = np.sqrt(square) + eps
        if mu:
            new["momentum"] = mu * slots["momentum"] + g / denom
            return p - lr * new["momentum"], new
        return p - lr * g / denom, new


def _overflows(*arrays: np.ndarray) -> bool:
    """Whether float32 could not hold every value (the ps refuses such an update)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return any(a.size and not (np.isfinite(a).all() and float(np.abs(a).max()) <= F32_MAX) for a in arrays)


@dataclass
class Pushed:
    worker: int
    version: int
    grad: np.ndarray
    rows: RowRequest = field(default_factory=RowRequest)
    """The rows it pushes, and the rows its reply carries (read, and created, when it is answered)."""
    key: Any = None
    """Which request it was (the connection's worker, request id): the key of the rows its reply must carry."""


@dataclass
class Model:
    """One shard as it should be; ``None`` fields until the chief's init was answered ``ok``."""

    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    rule: RuleModel | None = None
    mode: str = "async"
    replicas: int = 1
    staleness: int = 0
    steps: int = 0
    version: int = 0
    rule_step: int = 0
    params: np.ndarray = field(default_factory=lambda: np.zeros(0))
    slots: dict[str, np.ndarray] = field(default_factory=dict)
    epoch: int = 0
    pause: int | None = None
    held: list[Pushed] = field(default_factory=list)
    round: list[Pushed] = field(default_factory=list)
    slack: dict[str, float] = field(default_factory=dict)
    """Absolute error float32 may have gathered in the parameters (``""``) and in each slot since the last value
    the ps was given exactly (an init, a restore)."""
    clock: dict[int, int] = field(default_factory=dict)
    """Iterations each worker has finished (its pushes answered applied or dropped), as the policy counts them."""
    failed: bool = False
    tables: dict[str, TableModel] = field(default_factory=dict)
    """The shard's embedding tables (:mod:`psdk.fuzz.rows`), declared by the init; a restore keeps them."""
    replied: dict[Any, tuple[RowRequest, list[np.ndarray | None]]] = field(default_factory=dict)
    """Each push answered since the fuzzer last looked, by its key: its table part and the rows its reply must
    carry (``None`` for a table not followed)."""
    log: list[str] = field(default_factory=list)
    """What the model did, for the report of a disagreement."""

    @property
    def initialized(self) -> bool:
        return self.rule is not None

    @property
    def rounds(self) -> bool:
        """The mode gathers gradients into one update per version (its policy says); else each applies on arrival.

        A new mode is fuzzed as one of these two kinds; if it is neither, the
        model disagrees with the ps and the fuzzer says so: teach it here.
        """
        return POLICIES[self.mode].waits_for_rounds

    @property
    def done(self) -> bool:
        return self.initialized and self.version >= self.steps

    def _note(self, what: str) -> None:
        self.log.append(f"model: {what}")

    # ------------------------------------------------------------ lifecycle
    def init(self, fields: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """The chief's init, answered ``ok``: variables, rule, job, and the state to resume from if any."""
        self.names = list(fields["names"])
        self.shapes = [tuple(a.shape) for a in arrays[: len(self.names)]]
        self.rule = RuleModel(fields.get("rule") or {})
        job = fields["job"]
        self.mode, self.steps = str(job["sync"]["mode"]), int(job["steps"])
        self.replicas = int(job["sync"].get("replicas_to_aggregate") or job["num_workers"])
        self.staleness = int(job["sync"].get("staleness") or 0)
        self.epoch = int(fields.get("epoch") or 0)
        self.params = self._flat(arrays[: len(self.names)])
        self.slots, self.version, self.rule_step = self.rule.initial_slots(self.params.size), 0, 0
        if fields.get("restore"):
            self._restore_state(fields["restore"], arrays)
        declared = fields.get("tables") or {}
        self.tables = {str(spec["name"]): TableModel(spec, self.rule) for spec in declared.get("specs", [])}
        self.replied = {}
        self.round, self.held, self.pause, self.failed, self.clock, self.slack = [], [], None, False, {}, {}
        self._note(f"init at version {self.version}, {self.rule.name}, {self.mode}, {self.steps} steps")

    def restore(self, fields: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """The chief's restore, answered ``ok``: the checkpoint's state, a new epoch; what waited is gone."""
        self.params = self._flat(arrays[: len(self.names)])
        self._restore_state(fields["restore"], arrays)
        self.epoch = int(fields["epoch"])
        self.round, self.held, self.pause, self.clock = [], [], None, {}  # a new policy: its clocks start again
        self.slack = {}
        self._note(f"restored at version {self.version}, epoch {self.epoch}")

    def _restore_state(self, restore: dict[str, Any], arrays: list[np.ndarray]) -> None:
        n = len(self.names)
        for i, slot in enumerate(restore["slots"]):
            self.slots[str(slot)] = self._flat(arrays[n * (1 + i) : n * (2 + i)])
        self.version, self.rule_step = int(restore["version"]), int(restore["rule_step"])

    @staticmethod
    def _flat(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in arrays]) if arrays else np.zeros(0)

    def pause_at(self, target: int, refused: bool = False) -> None:
        """A chief's pause_at the ps took: held at ``target``, or here if past it (not once done).

        A target ahead of the shard submits the pushes an earlier pause held,
        in order, as the ps does (they may go on up to the new target);
        ``refused``: the ps refused the request (too many pauses wait) after
        it moved the pause, before that.
        """
        if self.done and self.version < target:
            return
        ahead, self.pause = target > self.version, max(target, self.version)
        self._note(f"paused at {self.pause}")
        if ahead and not refused:
            held, self.held = self.held, []
            for push in held:
                self.submit(push)

    def resume(self) -> list[tuple[int, str]]:
        """The pause ends: the pushes it held are submitted in the order they came."""
        self.pause = None
        held, self.held = self.held, []
        self._note(f"resumed, {len(held)} held")
        return [outcome for push in held for outcome in self.submit(push)]

    def stop_at(self, target: int) -> int:
        self.steps = min(self.steps, max(target, self.version))
        if self.done:
            self._release_round()
        return self.steps

    def _release_round(self) -> None:
        """The round's pushes are answered "done" (the job reached its target): their replies read rows."""
        released, self.round = self.round, []
        for push in released:
            self._answer(push)

    def _answer(self, push: Pushed) -> None:
        """A push answered with parameters: the rows its reply carries, read (and created) now."""
        rows = self.pull_rows(push.rows)
        if push.key is not None:
            self.replied[push.key] = (push.rows, rows)

    def pull_rows(self, request: RowRequest) -> list[np.ndarray | None]:
        """The rows a reply to ``request`` carries, read now in order (a training pull creates rows)."""
        return [self.tables[name].lookup(ids, create) for name, ids, create in request.pulls]

    def fail(self) -> None:
        self.failed, self.round, self.held = True, [], []

    # ---------------------------------------------------------------- pushes
    def submit(self, push: Pushed) -> list[tuple[int, str]]:
        """A push past the ps's checks: the outcomes the ps must answer now, ``(worker, outcome)``.

        ``refused`` means the update would overflow float32 (the ps answers
        an error and changes nothing).
        """
        if self.done:
            self._answer(push)
            return [(push.worker, "done")]
        if self.pause is not None and self.version >= self.pause:
            self.held.append(push)
            self._note(f"held worker {push.worker}'s push")
            return []
        if not self.rounds:  # applied on arrival (a staleness bound only holds the reply back)
            if not self._apply(push.grad, push.rows.pushes):
                return [(push.worker, "refused")]
            self._tick(push.worker)
            self._answer(push)
            return [(push.worker, "applied")]
        if push.version < self.version or any(p.worker == push.worker for p in self.round):
            self._note(f"dropped worker {push.worker}'s push from version {push.version}")
            self._tick(push.worker)
            self._answer(push)
            return [(push.worker, "dropped")]
        total = sum((p.grad for p in self.round), push.grad)
        if _overflows(total):
            return [(push.worker, "refused")]
        self.round.append(push)
        if len(self.round) < self.replicas:
            return []
        mean = total / self.replicas
        answered, self.round = self.round, []
        outcome = "applied" if self._apply(mean, self._round_rows(answered), 1.0 / self.replicas) else "dropped"
        for p in answered:
            self._tick(p.worker)
            self._answer(p)
        if self.done:
            self._release_round()
        return [(p.worker, outcome) for p in answered]

    def _tick(self, worker: int) -> None:
        self.clock[worker] = self.clock.get(worker, 0) + 1

    def beyond_bound(self, iterations: int, slowest: int) -> bool:
        """Whether a reply that lets a worker start iteration ``iterations + 1`` while the slowest live worker
        has finished ``slowest`` breaks the staleness bound (``ssp``; the other modes have none)."""
        return self.mode == "ssp" and iterations - self.staleness > slowest

    @staticmethod
    def _round_rows(pushes: list[Pushed]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """A round's row gradients by table: each id once, its rows summed over the round's pushes."""
        sums: dict[str, dict[int, np.ndarray]] = {}
        for push in pushes:
            for name, (ids, rows) in push.rows.pushes.items():
                table = sums.setdefault(name, {})
                for i, row in zip(ids.tolist(), rows, strict=True):
                    table[i] = table[i] + row if i in table else row.copy()
        return {
            name: (np.array(sorted(table), np.int64), np.array([table[i] for i in sorted(table)]))
            for name, table in sums.items()
        }

    def _apply(
        self, grad: np.ndarray, rows: dict[str, tuple[np.ndarray, np.ndarray]] | None = None, scale: float = 1.0
    ) -> bool:
        """One update: the dense gradient and each table's touched rows (times ``scale``), all or nothing."""
        assert self.rule is not None
        with np.errstate(all="ignore"):
            params, slots = self.rule.step(self.params, grad, self.slots, self.rule_step)
            staged = [
                self.tables[name].stage(ids, np.asarray(g, np.float64).reshape(len(ids), -1) * scale, self.rule_step)
                for name, (ids, g) in (rows or {}).items()
            ]
        blocks = [a for s in staged if s is not None for a in (s.rows, *s.slots.values())]
        if _overflows(params, *slots.values(), *blocks):
            self._note(f"refused an update at version {self.version} (it overflows float32)")
            return False
        for name, old, new in [("", self.params, params), *((n, self.slots[n], slots[n]) for n in slots)]:
            largest = max(abs_max(old), abs_max(new), abs_max(grad))
            self.slack[name] = self.slack.get(name, 0.0) + ROUNDING * largest
        self.params, self.slots = params, slots
        for stage in staged:
            if stage is not None:
                stage.table.commit(stage)
        self.version += 1
        self.rule_step += 1
        self._note(f"applied, now version {self.version}")
        return True

    # ------------------------------------------------------------ comparing
    def compare(self, version: int, params: np.ndarray, slots: dict[str, np.ndarray], rule_step: int) -> list[str]:
        """Where a shard's state differs from the model's (empty: it agrees within RTOL and ATOL)."""
        if not self.initialized:
            return []
        problems = []
        if version != self.version:
            problems.append(f"the ps is at version {version}, the model at {self.version}")
        if rule_step != self.rule_step:
            problems.append(f"the ps's rule step is {rule_step}, the model's {self.rule_step}")
        problems += _differs("parameters", params, self.params, self.slack.get("", 0.0))
        if set(slots) != set(self.slots):
            problems.append(f"the ps keeps slots {sorted(slots)}, the model {sorted(self.slots)}")
        for name in sorted(set(slots) & set(self.slots)):
            problems += _differs(f"slot {name}", slots[name], self.slots[name], self.slack.get(name, 0.0))
        return problems

    def compare_tables(self, held: dict[str, TableState]) -> list[str]:
        """Where the ps's tables (their rows, slots and dropped gradients) differ from the model's."""
        if not self.initialized:
            return []
        if set(held) != set(self.tables):
            return [f"the ps holds tables {sorted(held)}, the model {sorted(self.tables)}"]
        return [problem for name in sorted(held) for problem in self.tables[name].compare(held[name], RTOL, ATOL)]


def abs_max(values: np.ndarray) -> float:
    return float(np.abs(values).max(initial=0.0))


def _differs(what: str, got: np.ndarray, want: np.ndarray, slack: float) -> list[str]:
    got = np.asarray(got, np.float64).reshape(-1)
    if got.shape != want.shape:
        return [f"the ps's {what} have {got.size} values, the model's {want.size}"]
    with np.errstate(all="ignore"):
        bad = ~np.isclose(got, want, rtol=RTOL, atol=ATOL + slack)
    if not bad.any():
        return []
    i = int(np.argmax(bad))
    return [f"{what} differ at {int(bad.sum())} of {got.size} values, e.g. [{i}]: ps {got[i]:.7g}, model {want[i]:.7g}"]
