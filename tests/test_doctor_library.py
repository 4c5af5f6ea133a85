"""The graph doctor on a model from an installed package (CPU): what a user sees when the host sync
is inside the library, not in their own code.

The package is made in a ``site-packages`` folder (tests/helpers/library_sync_loop.py), so the doctor
takes it for an installed one. Its finding names the user's line and the package's line behind
it, with a fix the user can apply; the verdict and the finding are the same in one process, in
DDP on one gloo rank, and under torchrun with 2 gloo ranks (DDP's frames above the library's
forward no longer hide it); and so they are with the model sharded by FSDP2 (``fully_shard``,
which the doctor takes as it is, with no DDP around it): FSDP2's own calls (its hooks' buffers
and copies around each forward and backward) are seen and left out, the library's are judged,
and a model that makes no sync gets no finding. On CUDA the doctor's trial capture decides
whether the sync is in the graph (tests/test_doctor_hf_gpu.py, with transformers); here a
stand-in for the capture, which refuses a host sync as CUDA does, shows how that judgement reads.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from graphing.doctor import attribution
from graphing.doctor.capture_attempt import try_captures
from graphing.doctor.capture_judgement import judge
from graphing.doctor.step_runner import StepRunner
from helpers import library_sync_loop as loop
from helpers.launches import free_port, launch

FSDP2_DIR = str(Path(torch.__file__).parent / "distributed" / "fsdp")
USER_LINE = next(n for n, text in enumerate(Path(loop.__file__).read_text().splitlines(), 1)
                 if "# doctor: host_sync" in text)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = loop.write_package(tmp_path_factory.mktemp("installed"))
    yield site
    if str(site) in sys.path:
        sys.path.remove(str(site))
    for name in loop.PACKAGES:
        sys.modules.pop(name, None)


def library_finding(report, site, package="syncing_model"):
    """The one finding, as (kind, effect, user place, package place, where)."""
    assert len(report.findings) == 1, report.table()
    f = report.findings[0]
    assert f.library_file == str(site / package / "__init__.py"), report.table()
    return f.kind, f.effect, (f.file, f.line), f.library_line, f.where, f.fix


def expected(site, package="syncing_model"):
    return ("host_sync", "blocks", (str(Path(loop.__file__).resolve()), USER_LINE), loop.package_sync_line(),
            f"tests/helpers/library_sync_loop.py:{USER_LINE} -> {package}/__init__.py:{loop.package_sync_line()}")


@pytest.mark.fast
def test_a_librarys_host_sync_names_the_librarys_line_and_the_users_line(site):
    report = loop.diagnose_loop(site)
    assert report.verdict == "blocked" and report.exit_code == 7
    kind, effect, user, library_line, where, fix = library_finding(report, site)
    assert (kind, effect, user, library_line, where) == expected(site)
    assert where in report.table()
    # The fix is one the user can apply: not an edit of the library's line.
    assert fix.startswith("The call is made inside syncing_model, which your line calls: run the doctor on CUDA")
    assert "look for a setting of syncing_model" in fix and "keep this step eager" in fix


@pytest.fixture
def one_gloo_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.fast
def test_under_ddp_the_librarys_host_sync_is_found_as_in_one_process(site, one_gloo_rank):
    """DDP's forward calls the library's: DDP's own frames stay ignored, the library's are judged."""
    report = loop.diagnose_loop(site)
    assert report.world_size == 1 and report.verdict == "blocked", report.table()
    assert library_finding(report, site)[:5] == expected(site)  # as in one process (the test above)


@pytest.fixture(scope="module")
def two_gloo_ranks(site, tmp_path_factory):
    """The doctor's merged reports of 2 gloo ranks, the model in DDP and then sharded with FSDP2: one launch."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    done = launch([str(site), str(tmp / "reports.json"), "syncing_model", "ddp,fsdp2"],
                  script="tests/helpers/library_sync_loop.py", nproc=2, timeout=120, log_dir=tmp / "logs")
    assert done.returncode == 0, done.output[-3000:]
    return json.loads((tmp / "reports.json").read_text())


def test_two_gloo_ranks_give_the_verdict_and_finding_of_one_process(site, two_gloo_ranks):
    two = two_gloo_ranks["ddp"]
    one = loop.diagnose_loop(site)
    assert two["world_size"] == 2 and two["verdict"] == one.verdict == "blocked"
    assert [(f["kind"], f["effect"], f["where"], f["library_line"], f["fix"]) for f in two["findings"]] == \
        [(f.kind, f.effect, f.where, f.library_line, f.fix) for f in one.findings]
    assert two["findings"][0]["ranks"] == [0, 1]


@pytest.fixture(scope="module")
def one_process(site):
    """The plain one-process reports (no process group: set up before any test's gloo group), by package."""
    assert not dist.is_initialized()
    return {package: loop.diagnose_loop(site, package) for package in ("syncing_model", "quiet_model")}


def without_ranks(report: dict) -> dict:
    """A report's dict less what names the ranks (the world size, each finding's ranks)."""
    return {**{k: v for k, v in report.items() if k != "world_size"},
            "findings": [{k: v for k, v in f.items() if k != "ranks"} for f in report["findings"]]}


def diagnose_sharded(site, package):
    """The report on the FSDP2-sharded model, and (innermost file, tag) of each torch call the doctor saw
    while FSDP2's own code was making it."""
    seen = []

    def call_site(frame):
        site_ = attribution.call_site(frame)
        f = frame
        while f is not None and not attribution.is_user_file(f.f_code.co_filename) \
                and not attribution.is_package_file(f.f_code.co_filename):
            if FSDP2_DIR in f.f_code.co_filename:
                seen.append((frame.f_code.co_filename, site_.tag))
                break
            f = f.f_back
        return site_

    with mock.patch("graphing.doctor.interception.call_site", call_site):
        report = loop.diagnose_loop(site, package, parallel="fsdp2")
    return report, seen


@pytest.mark.fast
@pytest.mark.parametrize("package", ["syncing_model", "quiet_model"])
def test_under_fsdp2_the_doctor_reports_as_in_one_process(site, one_process, package, one_gloo_rank):
    """fully_shard on the library's blocks and root, one gloo rank: the same report as one process, to the
    library's line and the user's (syncing_model), or none at all (quiet_model: nothing false from FSDP2)."""
    report, fsdp2_calls = diagnose_sharded(site, package)
    one = one_process[package]
    assert report.to_dict() == one.to_dict(), f"{report.table()}\n--- one process:\n{one.table()}"
    if package == "syncing_model":
        assert library_finding(report, site)[:5] == expected(site)
    else:
        assert report.verdict == "ready" and report.findings == [] and report.notes == [], report.table()
    # Not vacuous: the doctor saw FSDP2's own calls in every step (its hooks' all-gather buffers and copies
    # into them, the unsharded parameters' views, its post-backward hook), and left each out as FSDP2's.
    assert len(fsdp2_calls) >= report.checked_steps and {tag for _, tag in fsdp2_calls} == {"ignore"}, fsdp2_calls


def test_under_fsdp2_two_gloo_ranks_give_the_report_of_one_process(one_process, two_gloo_ranks):
    two = two_gloo_ranks["fsdp2"]
    assert two["world_size"] == 2 and [f["ranks"] for f in two["findings"]] == [[0, 1]], two
    assert without_ranks(two) == without_ranks(one_process["syncing_model"].to_dict())


class _RefusesHostSyncs(TorchFunctionMode):
    """What CUDA does to a host sync during a capture: an error."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("item", "__bool__"):
            raise RuntimeError("operation not permitted when stream is capturing")
        return func(*args, **(kwargs or {}))


class _StandInGraph:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        with mock.patch("torch.cuda.is_current_stream_capturing", lambda: True):
            self.fn()

    def reset(self):
        pass


def _stand_in_capture(fn, stream, pool, mode):
    """graphing.capture.capture on the CPU: runs ``fn`` as capturing, refusing host syncs as CUDA would."""
    try:
        with mock.patch("torch.cuda.is_current_stream_capturing", lambda: True), _RefusesHostSyncs():
            fn()
    except RuntimeError as err:
        return None, 0.0, f"CUDA graph capture failed: the step synchronizes with the host.\n  underlying error: " \
                          f"RuntimeError: {err}"
    return _StandInGraph(fn), 0.0, None


def judged_by_trial_capture(site, package):
    step, model, optimizer, inputs = loop.build(site, package)
    out = torch.zeros(())

    def step_with_static_output(model, x, y):  # a graph's outputs are its own buffers, rewritten by each replay
        return out.copy_(step(model, x, y))

    report = loop.diagnose_loop(site, package)
    runner = StepRunner(step_with_static_output, model, inputs, torch.device("cpu"), None)
    with mock.patch("graphing.doctor.capture_attempt.capture", _stand_in_capture), \
            mock.patch("graphing.doctor.capture_attempt.reset_rng_capture_state"):
        trial = try_captures(runner, [optimizer] if optimizer else [], replays=3)
    return report, trial, judge(report.findings, trial, set())


@pytest.mark.fast
def test_a_sync_the_library_skips_while_capturing_is_an_eager_only_note(site):
    report, trial, (findings, notes) = judged_by_trial_capture(site, "capture_aware_model")
    assert report.verdict == "blocked"  # the eager steps alone
    assert trial.captured and trial.replays is not None and trial.replays.equal, trial.summary
    assert findings == []
    [note] = notes
    where = expected(site, "capture_aware_model")[4]
    assert note.startswith(f"eager only; not in the graph: host_sync at {where}")
    assert note.endswith("(capture_aware_model skips it while a CUDA stream is capturing); nothing needs changing")


@pytest.mark.fast
def test_a_sync_the_library_makes_while_capturing_stays_a_blocker_with_a_fix_the_user_can_apply(site):
    report, trial, (findings, notes) = judged_by_trial_capture(site, "syncing_model")
    assert not trial.captured and trial.failure is not None and notes == []
    [finding] = findings
    assert (finding.kind, finding.effect, finding.where) == ("host_sync", "blocks", expected(site)[4])
    assert finding.fix.startswith("The call is made inside syncing_model, which your line calls, and the trial "
                                  "capture made it too: look for a setting of syncing_model")
