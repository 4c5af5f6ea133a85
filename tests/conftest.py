"""Shared helpers: launch a script the way a user does (python or torchrun) and find its outputs.

``Launch`` is the tests' one way to start a process: ``python train.py`` (or any script), or torchrun
with ``nproc`` gloo/NCCL ranks; ``start`` begins one, ``launch`` runs one to its end, ``launch_together``
runs several side by side. Every launch has a hard time limit: a hung rank fails its test, with the
stacks of the hung processes, and never hangs the suite.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"  # what tests use that is not a test: helper scripts, the doctor's gallery
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HELPERS))

LAUNCH_TIMEOUT_S = 240.0  # one launch, at most, unless a test says otherwise
# Every process a launch starts (torchrun, ranks, loader workers, W&B) carries this variable, valued
# "<this pytest session>-<the launch>": found by it, whatever its parent or session.
MARK = "GRAPHED_DDP_TEST_LAUNCH"
SESSION = uuid.uuid4().hex[:12]
LOGS = Path(tempfile.gettempdir()) / f"graphed_ddp_test_launches_{SESSION}"  # launches that name no folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *, rdzv_endpoint: Optional[str] = None, rdzv_id: str = "test", max_restarts: int = 0,
             extra: Optional[List[str]] = None) -> List[str]:
    """The torchrun command line (without the script): one node of ``nproc`` ranks, a c10d rendezvous whose store
    the agent opens on a port the system picks (port 0, as ``--standalone`` does) unless ``rdzv_endpoint`` names
    one (several agents, one job), ``extra`` torchrun flags after these. A port picked here and handed over
    could be taken by a launch beside this one before its agent binds it (seen on a GPU machine running four
    test files at once: the agent then waited 60 s on the other job's store and failed)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint or '127.0.0.1:0'}", f"--rdzv-id={rdzv_id}",
            f"--max-restarts={max_restarts}", *(extra or [])]


def process_state(pid: int) -> Optional[str]:
    """The kernel's one-letter state of a process (R, S, D, Z for a zombie, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def is_live(pid: int) -> bool:
    """Neither gone nor a zombie (dead, not yet reaped by its parent)."""
    return process_state(pid) not in (None, "Z")


def marked_pids(value: str, prefix: bool = False) -> List[int]:
    """Live (not zombie) processes whose environment holds ``MARK=value`` (or a value starting with it)."""
    needle = f"{MARK}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if any(v == needle or (prefix and v.startswith(needle)) for v in environ.split(b"\0")) and is_live(int(entry)):
            found.append(int(entry))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()[:200]
    except OSError:
        return "(gone)"


def _state(pid: int) -> str:
    """The kernel's view of a process: its state and what it waits in (wchan)."""
    state = process_state(pid)
    try:
        return "gone" if state is None else f"state {state}, waiting in {Path(f'/proc/{pid}/wchan').read_text() or '-'}"
    except OSError:
        return "gone"


def _stacks(pids: List[int]) -> str:
    """Where each process is (py-spy, where installed): what a hung launch reports before it is killed."""
    spy = shutil.which("py-spy")
    lines = []
    for pid in pids:
        lines.append(f"--- pid {pid} ({_state(pid)}): {_cmdline(pid)}")
        if spy:
            try:
                dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
                lines.append((dump.stdout + dump.stderr).strip())
            except (OSError, subprocess.SubprocessError) as e:
                lines.append(f"(py-spy: {e})")
    if not spy:
        lines.append("(pip install py-spy to see their stacks here)")
    return "\n".join(lines)


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str  # empty where the launch merged it into stdout
    output_root: Optional[Path] = None
    ended: float = 0.0  # time.monotonic() when the launched process exited
    left: List[str] = field(default_factory=list)  # its processes still alive 10 s after it ended (then killed)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def run_dirs(self) -> List[Path]:
        return sorted(p.parent for p in self.output_root.rglob("config.yaml"))

    @property
    def run_dir(self) -> Path:
        dirs = self.run_dirs
        assert len(dirs) == 1, f"expected one run directory, found {dirs}\n{self.stderr[-3000:]}"
        return dirs[0]

    def results(self) -> Dict:
        return json.loads((self.run_dir / "results.json").read_text())

    def metrics(self) -> List[Dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


class Launch:
    """``python script args`` (nproc None) or ``torchrun --nproc_per_node=nproc script args``, in the background.

    ``faults`` (tests/helpers/fault_injection.py's variables) or ``kill_at_step`` ("STEP" or "STEP:RANK": that rank, 1 by
    default, is killed right after that step on the job's first attempt) run train.py through
    tests/helpers/fault_injection.py. ``torchrun_args``: ``torchrun()``'s keywords (rdzv_endpoint, rdzv_id, max_restarts,
    extra). Output goes to files in ``log_dir`` (a pipe that a rank inherits can keep its reader waiting), stderr
    into stdout's file with ``merge_output``. The launch runs in a session of its own, like a terminal's job: a
    signal to its group (``os.killpg(launch.proc.pid, ...)``) reaches torchrun and every rank.
    """

    def __init__(self, args: List[str], log_dir: Path, *, script: str = "train.py", nproc: Optional[int] = None,
                 torchrun_args: Optional[Dict] = None, env: Optional[Dict[str, str]] = None,
                 faults: Optional[Dict[str, str]] = None, kill_at_step: Optional[str] = None,
                 merge_output: bool = False, cwd: Path = ROOT, name: str = "launch"):
        from fault_injection import FAULT_ENVS, KILL_AT_STEP_ENV

        faults = dict(faults or {})
        if kill_at_step is not None:
            faults[KILL_AT_STEP_ENV] = kill_at_step
        if faults:
            assert script == "train.py", "faults are injected into train.py only"
            script = "tests/helpers/fault_injection.py"
        launcher = [sys.executable] if nproc is None else torchrun(nproc, **(torchrun_args or {}))
        self.marker = f"{SESSION}-{uuid.uuid4().hex}"
        full_env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE" and k not in FAULT_ENVS}  # W&B offline
        full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **faults,
                         **(env or {}), MARK: self.marker})
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        self.cmd = [*launcher, script, *args]  # script: relative to cwd (the checkout's root by default)
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(self.cmd, cwd=cwd, env=full_env, stdout=out,
                                         stderr=subprocess.STDOUT if merge_output else err, start_new_session=True)
        self.started = time.monotonic()

    def output(self) -> str:
        return self.stdout_path.read_text() + self.stderr_path.read_text()

    def pids(self) -> List[int]:
        """Live processes of this launch, found by its marker."""
        return marked_pids(self.marker)

    def signal_all(self, sig) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait_until(self, ready: Callable[[], bool], what: str, timeout: float = 120) -> None:
        """Polls ``ready()`` while the launch runs; fails the test if it ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"the launch ended (exit {self.proc.returncode}) before {what}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"no {what} within {timeout:.0f} s:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        self.signal_all(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def finish(self, timeout: float = LAUNCH_TIMEOUT_S, output_root: Optional[Path] = None) -> Finished:
        """Waits for the launch to end, at most ``timeout`` s from now: past it, the test fails with where every
        process of the launch was, and they are all killed."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = _stacks(self.pids())
            self.kill()
            pytest.fail(f"{' '.join(self.cmd)[:300]}\nran past {timeout:.0f} s (a hung rank?); killed. Where its "
                        f"processes were:\n{stacks}\n--- its output:\n{self.output()[-4000:]}")
        ended = time.monotonic()
        left = self.pids()
        deadline = ended + 10  # a loader worker or W&B may take a moment after its parent
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.pids()
        names = [_cmdline(pid) for pid in left]
        self.signal_all(signal.SIGKILL)
        return Finished(self.proc.returncode, self.stdout_path.read_text(), self.stderr_path.read_text(),
                        output_root, ended, names)


def start(args: List[str], output_root: Optional[Path] = None, *, log_dir: Optional[Path] = None, **kw) -> Launch:
    """Starts ``python train.py output_root=... args`` (or ``script``; under torchrun with ``nproc``) in the
    background. ``output_root`` None: no output_root override (scripts with flags of their own). The output files
    go to ``log_dir`` (default: beside output_root, or a folder of this session's, removed at its end). Other
    keywords: ``Launch``'s."""
    if output_root is not None:
        args = [f"output_root={output_root}", *args]
    if log_dir is None:
        log_dir = output_root.parent / "launch_logs" if output_root is not None else LOGS
    return Launch(args, log_dir, name=uuid.uuid4().hex[:8], **kw)


def launch(args: List[str], output_root: Optional[Path] = None, *, timeout: float = LAUNCH_TIMEOUT_S,
           log_dir: Optional[Path] = None, **kw) -> Finished:
    """``start``'s launch, run to its end (at most ``timeout`` s)."""
    return start(args, output_root, log_dir=log_dir, **kw).finish(timeout, output_root)


def launch_together(args_by_name: Dict[str, List[str]], root: Optional[Path] = None, *,
                    timeout: float = LAUNCH_TIMEOUT_S, each: Optional[Dict[str, Dict]] = None,
                    **kw) -> Dict[str, Finished]:
    """Several independent launches at once, each into ``root / name`` (root None: no output_root, as ``start``):
    on a 2-core machine one launch's waits (process start, rendezvous) are another's compute, so two take about
    0.8x the time of one after the other. ``kw``: ``Launch``'s keywords for all; ``each[name]``: for one."""
    roots = {name: None if root is None else root / name for name in args_by_name}
    started = {name: start(args, roots[name], **{**kw, **(each or {}).get(name, {})})
               for name, args in args_by_name.items()}
    try:
        return {name: one.finish(timeout, roots[name]) for name, one in started.items()}
    finally:
        for one in started.values():  # a launch left running by a failed finish above
            if one.proc.poll() is None:
                one.kill()


@pytest.fixture(scope="session", autouse=True)
def no_launch_outlives_the_session():
    """A launch a test abandoned (an error between start and finish) is killed when the session ends."""
    yield
    for pid in marked_pids(SESSION, prefix=True):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(LOGS, ignore_errors=True)


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "outputs"


@pytest.fixture(scope="session")
def debug_run_with_host_workers_and_a_broken_wandb(tmp_path_factory) -> Finished:
    """``python train.py experiment=debug`` whose host loader has worker processes and whose W&B
    cannot start (WANDB_MODE=not-a-mode): one launch, read by test_data and test_training."""
    return launch(["experiment=debug", "train.progress=false", "recipe.data.loader=host",
                   "recipe.data.num_workers=2"], tmp_path_factory.mktemp("debug_host") / "outputs", timeout=90,
                  env={"WANDB_MODE": "not-a-mode"})


@pytest.fixture(scope="session")
def mnist_files(tmp_path_factory) -> Path:
    """A small MNIST in torchvision's raw format (2048 train, 300 test images) under ``<root>/MNIST/raw``."""
    from mnist_files import write_idx_mnist

    root = tmp_path_factory.mktemp("mnist_files") / "data"
    write_idx_mnist(root, 2048, 300)
    return root


@pytest.fixture(scope="session")
def two_ranks_on_mnist_files(tmp_path_factory, mnist_files) -> Finished:
    """Two gloo ranks, 8 steps on the MNIST files found under recipe.data.root (source=auto), each rank
    logging its own W&B run (offline): one launch, read by test_real_data and test_training."""
    return launch([f"recipe.data.root={mnist_files}", "recipe.data.source=auto", "recipe.data.eval_batch_size=128",
                   "train.max_steps=8", "train.log_every=8", "logger.wandb.all_ranks=true"],
                  tmp_path_factory.mktemp("real_data") / "outputs", nproc=2, timeout=120)


# Two gloo ranks, one epoch of cifar10_resnet18 (4 steps of 16 per rank) on synthetic images, with the default
# train.ddp settings: one launch, read by test_recipes and test_ddp_settings.
TWO_RANKS_ON_CIFAR = ["recipe=cifar10_resnet18", "recipe.data.source=synthetic", "recipe.data.train_size=128",
                      "recipe.data.batch_size=16", "recipe.data.test_size=64", "recipe.data.eval_batch_size=16",
                      "train.epochs=1", "train.log_every=2", "recipe.schedule.warmup_steps=2", "logger=none",
                      "train.progress=false"]


@pytest.fixture(scope="session")
def two_ranks_on_cifar(tmp_path_factory) -> Finished:
    return launch(TWO_RANKS_ON_CIFAR, tmp_path_factory.mktemp("cifar") / "outputs", nproc=2, timeout=180)


@pytest.fixture
def train_here(capsys, tmp_path):
    """Runs train.py's session in this process (one rank, no launch): ``(overrides) -> Finished``.

    The fast way to see what a user sees for a config: exit code, message, files.
    """
    from conf.schema import compose
    from trainer.training import train as run

    def train(overrides: List[str], output_root: Optional[Path] = None) -> Finished:
        output_root = output_root or tmp_path / "outputs"
        cfg = compose([f"output_root={output_root}", "train.progress=false", *overrides])
        code = run(cfg)
        captured = capsys.readouterr()
        return Finished(code, captured.out, captured.err, output_root)

    return train


def torch_loads(path) -> bool:
    """The tests' own oracle for a checkpoint file, independent of trainer.checkpoint: does torch load it?"""
    import torch
    try:
        torch.load(path, weights_only=True)
        return True
    except Exception:
        return False


def cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# Optional extras: the module a test needs -> the requirements file that installs it. The README's set-up installs
# requirements.txt alone, so a test that needs one of these skips without it, saying how to get it.
EXTRAS = {"transformers": "requirements-hf.txt"}


def needs_extra(module: str):
    """The optional ``module`` (imported), or a skip that names it and the command that installs it. Tests that
    call this carry ``pytest.mark.extras``: CI installs every extra after the README's pytest, then runs
    ``pytest -m extras``."""
    return pytest.importorskip(module, reason=f"needs the optional {module}: pip install -r {EXTRAS[module]}")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs; skipped without them (run on the GPU machine)")
    config.addinivalue_line("markers", "extras: needs an optional extra (requirements-hf.txt); skipped without it")
    config.addinivalue_line("markers", "fast: in-process, no launches: the edit-test loop (pytest -m fast)")
