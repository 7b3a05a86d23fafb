"""Every fenced code block of README.md and docs/*.md runs here, with short step counts, or says why not.

A block's language picks its runner: ``sh`` and ``bash`` run line by line, ``python`` as a script;
``yaml``, ``json``, ``toml`` and ``text`` are listings, not code. Anything else, and a block that
cannot run on one machine without GPUs, carries a marker: an HTML comment on the line before its
fence, which GitHub does not show. A skip needs its reason, and pytest shows it::

    <!-- doc-test: skip (needs a Ray cluster) -->
    <!-- doc-test: not code (log output) -->
    <!-- doc-test: continues -->      runs after the block before it, in the same folder
    <!-- doc-test: torch workers -->  a worker script: two processes (task 0 and 1) against a ps
    <!-- doc-test: keras workers -->  that listens where the script says 127.0.0.1:2222; x, y given
                                      and a tenth of its steps=N

A block with neither a runner nor a marker fails, so new docs cannot slip through.

Each block runs in a fresh folder with ``PSDK_DATA_DIR`` set. A shell line must be a
``python -m psdk`` command, or ``tensorboard --logdir DIR``, whose folder is checked for event files
instead of served. What makes each command fast: ``run`` gets a fiftieth of the ``train.steps`` it
documents (60 for the default 12,000 or a preset's; of its ``train.epochs``, at most 0.1), no
validation, plot or live display, its own output folder, and ``backend=numpy`` unless it names a
backend; ``bench`` and ``fuzz`` get their own size flags. The documented placeholders are filled
in: MNIST folders (``/path/to/mnist``,
``/data/mnist``, ``/data/fashion-mnist``: all MNIST-format) with the real one, ``outputs/<run>`` or a
dated run folder with the block's newest run (a sweep's runs count), a dated ``multirun/`` folder
with its newest sweep. A ``run`` that an earlier block ran word for word is not run again.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import pytest

from psdk.launch import announce

from .conftest import MNIST_DIR, REPO
from .test_docs import INLINE_CODE, doc_files, prose_lines

pytestmark = pytest.mark.timeout(300)

FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*doc-test:\s*(?P<kind>[a-z ]+?)\s*(?:\((?P<note>.*)\))?\s*-->$")
SHELL = ("sh", "bash")
LISTINGS = ("yaml", "json", "toml", "text")
TIMEOUT_S = 240
FRAMEWORKS = {"torch": "torch", "tf": "tensorflow", "keras": "tensorflow", "tensorflow": "tensorflow", "jax": "jax"}

WORKER_PRELUDES = {
    "torch workers": "import sys\nimport torch\n\ntask = int(sys.argv[1])\ntorch.manual_seed(task)\n"
    "x, y = torch.rand(100, 784), torch.randint(10, (100,))\n\n",
    "keras workers": "import sys\nimport numpy as np\n\ntask = int(sys.argv[1])\nrng = np.random.default_rng(task)\n"
    "x, y = rng.random((100, 784), dtype=np.float32), rng.integers(0, 10, 100)\n\n",
}
"""What a worker block takes as given: its task index (argv[1]) and one batch."""
ONE_THREAD = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
"""Two workers and a ps share the cores, as examples/torch_worker.py's set_num_threads(1) says."""

SHORT = {
    "bench": {"reps": "1", "steps": "40", "transport_sizes": "[1000]", "transport_reps": "1", "load_seconds": "1"}
    | {"flood_seconds": "1", "curve_reps": "1", "timeout_s": "120"},
    "fuzz": {"sequences": "5", "steps": "10", "count": "2000"},
    "keys": {},
    "data": {},
    "report": {},
    "plugins": {},
}
"""The psdk commands a block may run, with their settings for a short run (``run`` has its own below)."""

MNIST_PLACEHOLDER = re.compile(r"/path/to/mnist|/data/(?:fashion-)?mnist")
DATED = r"(?:<date>/<time>|\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d)"
RUN_PLACEHOLDER = re.compile(rf"outputs/(?:<run>|{DATED})")
SWEEP_PLACEHOLDER = re.compile(rf"multirun/{DATED}")
MARK_IT = "mark the block <!-- doc-test: skip (why) -->"
RAN: set[str] = set()
"""``run`` commands this session already ran, word for word."""


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    marker: str | None
    root: Block | None = None
    """The block this one continues."""
    followers: list[Block] = field(default_factory=list)

    @property
    def id(self) -> str:
        name = self.path.relative_to(REPO).as_posix() if self.path.is_relative_to(REPO) else self.path.name
        return f"{name}:{self.line}"


def read_blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, each with the HTML comment on the line before it (blank lines skipped)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    number = 0
    while number < len(lines):
        match = FENCE.match(lines[number])
        if match is None:
            number += 1
            continue
        end = next((i for i in range(number + 1, len(lines)) if lines[i].strip() == "```"), len(lines))
        before = next((lines[i].strip() for i in range(number - 1, -1, -1) if lines[i].strip()), "")
        block = Block(path, number + 1, match.group(1), "\n".join(lines[number + 1 : end]), None)
        if before.startswith("<!--") and "doc-test" in before:
            block.marker = before
        found = MARKER.match(block.marker or "")
        if found and found["kind"] == "continues" and blocks:
            block.root = blocks[-1].root or blocks[-1]
            block.root.followers.append(block)
        blocks.append(block)
        number = end + 1
    return blocks


def action(block: Block) -> tuple[str, str]:
    """What the test does with ``block``: ("run", its runner), ("skip", why) or ("fail", what is wrong)."""
    runner = "sh" if block.lang in SHELL else block.lang
    if block.marker is None:
        if runner in ("sh", "python"):
            return "run", runner
        if block.lang in LISTINGS:
            return "skip", f"not code: a {block.lang} listing"
        return "fail", (
            f"a ```{block.lang} block has no runner: mark it <!-- doc-test: skip (why it cannot run here) --> "
            "or <!-- doc-test: not code (what it is) -->"
        )
    found = MARKER.match(block.marker)
    kind, note = (found["kind"], (found["note"] or "").strip()) if found else ("", "")
    if kind == "continues":
        if block.root is None:
            return "fail", "marked `continues` but no block comes before it"
        if ("sh" if block.root.lang in SHELL else block.root.lang) != runner:
            return "fail", f"continues {block.root.id}, a block in another language"
        return "skip", f"runs after {block.root.id}, in its folder"
    if kind in ("skip", "not code"):
        if not note:
            return "fail", f"the marker needs its reason: <!-- doc-test: {kind} (why) -->"
        return "skip", note if kind == "skip" else f"not code: {note}"
    if kind in WORKER_PRELUDES:
        if runner != "python" or "127.0.0.1:2222" not in block.code:
            return "fail", f"`{kind}` is for a python script that connects to 127.0.0.1:2222"
        return "run", kind
    return "fail", f"cannot read the marker {block.marker!r}: skip (why), not code (what), continues, torch workers"


BLOCKS = [block for path in doc_files() for block in read_blocks(path)]


def test_every_block_has_a_runner_or_a_marker_with_its_reason() -> None:
    assert [f"{b.id}: {action(b)[1]}" for b in BLOCKS if action(b)[0] == "fail"] == []


def test_markers_are_read_as_documented(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```sh\npython -m psdk keys\n```\n<!-- doc-test: continues -->\n\n```sh\npython -m psdk plugins\n```\n"
        "<!-- doc-test: skip (needs a Ray cluster) -->\n```sh\nray start\n```\n"
        "<!-- doc-test: skip -->\n```\nx\n```\n```console\n$ x\n```\n```yaml\na: 1\n```\n"
    )
    first, second, ray, unexplained, console, listing = read_blocks(page)
    assert action(first) == ("run", "sh") and first.followers == [second]
    assert action(second) == ("skip", f"runs after {first.id}, in its folder")
    assert action(ray) == ("skip", "needs a Ray cluster") and action(listing) == ("skip", "not code: a yaml listing")
    assert action(unexplained)[0] == action(console)[0] == "fail"


# ------------------------------------------------------------------ running a block
@dataclass
class Folder:
    """Where a block runs, and the runs and sweeps its commands made there."""

    cwd: Path
    env: dict[str, str]
    runs: list[Path] = field(default_factory=list)
    sweeps: list[Path] = field(default_factory=list)


def needs(names: list[str]) -> None:
    """Skip when a framework the block uses is not installed; with ``PSDK_NO_SKIP`` (CI), fail instead."""
    missing = sorted({FRAMEWORKS[n] for n in names if n in FRAMEWORKS and find_spec(FRAMEWORKS[n]) is None})
    if missing:
        (pytest.fail if os.environ.get("PSDK_NO_SKIP") else pytest.skip)(f"{', '.join(missing)} not installed")


def newest(found: list[Path], what: str) -> str:
    if not found:
        pytest.fail(f"{what} names a folder, but the block made none before this line")
    return str(found[-1])


def fill(arg: str, folder: Folder) -> str:
    """``arg`` with the documented placeholders replaced by what exists here."""
    arg = MNIST_PLACEHOLDER.sub(str(MNIST_DIR), arg)
    arg = RUN_PLACEHOLDER.sub(lambda m: newest(folder.runs, m[0]), arg)
    return SWEEP_PLACEHOLDER.sub(lambda m: newest(folder.sweeps, m[0]), arg)


def with_settings(args: list[str], settings: dict[str, str]) -> list[str]:
    """``args`` with each setting replacing the documented value of its key, or appended."""
    out = list(args)
    where = {a.split("=", 1)[0]: i for i, a in enumerate(args) if "=" in a and not a.startswith("-")}
    for key, value in settings.items():
        if key in where:
            out[where[key]] = f"{key}={value}"
        else:
            out.append(f"{key}={value}")
    return out


def short_run(args: list[str], folder: Folder) -> tuple[list[str], Path]:
    """A ``run``'s arguments for a job of seconds, and the folder of its own they give it."""
    documented = next((a.split("=", 1)[1] for a in args if a.startswith("train.steps=")), "3000")
    steps = max(20, int(documented) // 50) if documented.isdigit() else 60
    number = len(folder.runs) + len(folder.sweeps)
    sweep = "-m" in args or "--multirun" in args
    settings = {"train.steps": str(steps), "train.validate_every": "0", "train.log_every": "20"}
    epochs = next((a.split("=", 1)[1] for a in args if a.startswith("train.epochs=")), None)
    if epochs is not None:  # train.epochs sets the steps (giving both is refused): a fiftieth, at most 0.1 epoch
        del settings["train.steps"]
        settings["train.epochs"] = f"{min(float(epochs) / 50, 0.1):g}"
    settings |= {"progress.mode": "off", "report.plot": "false"}
    if not any("backend" in a for a in args):
        settings["backend"] = "numpy"
    target = Path("multirun" if sweep else "outputs", str(number))
    settings["hydra.sweep.dir" if sweep else "hydra.run.dir"] = str(target)
    return with_settings(args, settings), folder.cwd / target


def run_psdk(argv: list[str], env: dict[str, str], folder: Folder, line: str) -> None:
    result = subprocess.run(
        [sys.executable, *argv[1:]], cwd=folder.cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    output = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, f"`{line}` ran as `{shlex.join(argv[3:])}` and exited {result.returncode}:\n{output}"


def run_shell(code: str, folder: Folder) -> None:
    """Each line in turn, as a shell would, with the short settings; the first failing line fails the test."""
    cacheable = not (RUN_PLACEHOLDER.search(code) or SWEEP_PLACEHOLDER.search(code))
    for line in re.sub(r"\\\n", " ", code).splitlines():
        argv = shlex.split(line, comments=True)
        env = dict(folder.env)
        while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
            name, _, value = argv.pop(0).partition("=")
            env[name] = fill(value, folder)
        if not argv:
            continue
        argv = [fill(a, folder) for a in argv]
        if argv[0] == "tensorboard" and "--logdir" in argv:
            logdir = folder.cwd / argv[argv.index("--logdir") + 1]
            assert list(logdir.rglob("events.out.tfevents.*")), f"`{line}`: {logdir} holds no event files"
            continue
        if argv[:3] not in (["python", "-m", "psdk"], ["python3", "-m", "psdk"]) or len(argv) < 4:
            pytest.fail(f"`{line}`: only python -m psdk commands run here; {MARK_IT}")
        command, args = argv[3], argv[4:]
        needs([w for a in args for w in re.findall(r"\w+", a.partition("=")[2]) if "backend" in a])
        if command == "run":
            key = shlex.join(argv)
            if cacheable and key in RAN:
                continue
            short, target = short_run(args, folder)
            run_psdk([*argv[:4], *short], env, folder, line)
            RAN.add(key)
            if target.parent.name == "multirun":
                folder.sweeps.append(target)
                folder.runs += sorted((p for p in target.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
            else:
                folder.runs.append(target)
        elif command in SHORT:
            run_psdk([*argv[:4], *with_settings(args, SHORT[command])], env, folder, line)
        else:
            pytest.fail(f"`{line}`: `psdk {command}` is one task of a job; {MARK_IT}")


def run_python(code: str, folder: Folder) -> None:
    needs(re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.MULTILINE))
    (folder.cwd / "block.py").write_text(code + "\n")
    result = subprocess.run(
        [sys.executable, "block.py"], cwd=folder.cwd, env=folder.env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def run_workers(prelude: str, code: str, folder: Folder) -> None:
    """Keys, a ps on a free port, and the block as worker 0 (the chief) and worker 1, each a process."""
    needs([*re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.MULTILINE), *re.findall(r"\w+", prelude)])
    psdk = [sys.executable, "-m", "psdk"]
    made = subprocess.run([*psdk, "keys", "keys_dir=keys", "workers=2"], cwd=folder.cwd, env=folder.env, timeout=60)
    assert made.returncode == 0
    ps_args = ["ps_hosts=127.0.0.1:0", "worker_hosts=localhost,localhost", "transport.keys_dir=keys"]
    ps_args += [f"ps.announce_file={announce.file_for(folder.cwd, 0)}", "hydra.run.dir=ps"]
    logs = {"ps": folder.cwd / "ps.log", 0: folder.cwd / "worker0.log", 1: folder.cwd / "worker1.log"}

    def start(argv: list[str], log: Path, extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        env = dict(folder.env, **(extra or {}))
        with log.open("wb") as out:
            return subprocess.Popen(argv, cwd=folder.cwd, env=env, stdout=out, stderr=subprocess.STDOUT)

    ps = start([*psdk, "ps", *ps_args], logs["ps"])
    workers: list[subprocess.Popen[bytes]] = []
    try:

        def ps_alive() -> None:
            assert ps.poll() is None, f"the ps exited before it listened:\n{logs['ps'].read_text()}"

        (address,) = announce.wait_for(folder.cwd, 1, 60.0, ps_alive)
        code = re.sub(r"\bsteps=(\d+)", lambda m: f"steps={max(20, int(m[1]) // 10)}", code)
        (folder.cwd / "block.py").write_text(prelude + code.replace("127.0.0.1:2222", address) + "\n")
        workers = [start([sys.executable, "block.py", str(i)], logs[i], ONE_THREAD) for i in (0, 1)]
        codes = [w.wait(timeout=TIMEOUT_S) for w in workers] + [ps.wait(timeout=30)]
    finally:
        for process in (ps, *workers):
            process.kill()
    assert codes == [0, 0, 0], "\n".join(f"--- {name}:\n{log.read_text()[-3000:]}" for name, log in logs.items())


def runner(verdict: str) -> Callable[[str, Folder], None]:
    if verdict in WORKER_PRELUDES:
        return lambda code, folder: run_workers(WORKER_PRELUDES[verdict], code, folder)
    return run_shell if verdict == "sh" else run_python


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_the_block_runs(block: Block, tmp_path: Path, psdk_mnist_dir: Path) -> None:
    verdict, detail = action(block)
    if verdict == "skip":
        pytest.skip(f"{block.id}: {detail}")
    if verdict == "fail":
        pytest.fail(f"{block.id}: {detail}")
    folder = Folder(tmp_path, dict(os.environ, PSDK_DATA_DIR=str(psdk_mnist_dir), PYTHONUNBUFFERED="1"))
    for part in (block, *block.followers):
        runner(detail)(part.code, folder)


# ------------------------------------------------------------------ names in the prose
CALLED = re.compile(r"(?<![\w.])psdk(?:\.[A-Za-z_]\w*)+")


def names_scripts_use() -> dict[str, str]:
    """Each ``psdk.a.b`` a reader's script would write, with where: in inline code with a call, or a python block."""
    found: dict[str, str] = {}
    for path in doc_files():
        where = path.relative_to(REPO).as_posix()
        for number, line in prose_lines(path.read_text(encoding="utf-8")):
            for span in INLINE_CODE.findall(line):
                if "(" in span:
                    found.update(dict.fromkeys(CALLED.findall(span), f"{where}:{number}"))
    for block in BLOCKS:
        if block.lang == "python":
            code = "\n".join(li for li in block.code.splitlines() if not re.match(r"\s*(from|import)\s", li))
            found.update(dict.fromkeys(CALLED.findall(code), block.id))
    return found


def test_every_psdk_name_a_script_would_use_is_there_after_a_bare_import_psdk() -> None:
    """``psdk.rules.SGD`` works in a script that did only ``import psdk``; ``psdk.ps.rules.SGD`` worked only
    where something had imported psdk.ps.rules before, so a name counts only as ``import psdk`` alone gives it:
    what the fresh module holds, or what its lazy ``__getattr__`` provides."""
    found = names_scripts_use()
    check = (
        "import json, sys, psdk\nfresh, missing = set(vars(psdk)), []\nfor name in json.loads(sys.argv[1]):\n"
        "    first, *rest = name.split('.')[1:]\n    try:\n"
        "        obj = getattr(psdk, first) if first in fresh else psdk.__getattr__(first)\n"
        "        for part in rest:\n            obj = getattr(obj, part)\n"
        "    except AttributeError:\n        missing.append(name)\nprint(json.dumps(missing))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check, json.dumps(sorted(found))], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert [f"{found[name]}: {name}" for name in json.loads(result.stdout)] == []
