"""A user trains with their own loop through graphing.GraphedStep (scripts/own_loop.py).

The script runs as a real subprocess, under plain python or torchrun, the way a user
starts it. CPU tests hide any GPU (CUDA_VISIBLE_DEVICES=""), so they check the CPU
behaviour (gloo, eager; the model sharded with --fsdp2 learning as DDP's does; full refused)
on every machine. The GPU tests run eager and full
with the same seed (one GPU, and two under torchrun) and compare them step for step. The
own-loop guide's code (docs/own_loop.md) is checked to be the script's, verbatim.
"""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from helpers.launches import Finished, launch, launch_together
from helpers.paths import ROOT

SCRIPT = "scripts/own_loop.py"
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def run_own_loop(args: List[str], *, nproc: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 timeout: float = 180) -> Finished:
    """``python scripts/own_loop.py args`` (nproc None) or the same under torchrun with nproc processes."""
    return launch(args, script=SCRIPT, nproc=nproc, env=env, timeout=timeout)


def results_of(proc: Finished, path: Path) -> Dict:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(path.read_text())


def expected_lr(t: int, schedule: Dict) -> float:
    """The schedule the script states (linear warm-up, then cosine to min), in plain Python."""
    peak, low, warmup, total = schedule["peak"], schedule["min"], schedule["warmup"], schedule["total"]
    if t < warmup:
        return peak * (t + 1) / warmup
    progress = min(1.0, max(0.0, (t - warmup) / max(1, total - warmup)))
    return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * progress))


def assert_lr_schedule_followed(res: Dict) -> None:
    """Every step got the lr of its own index: warm-up, then cosine, as the script states."""
    lrs = res["lrs"]
    assert len(lrs) == res["steps"]
    for t, lr in enumerate(lrs):
        assert lr == pytest.approx(expected_lr(t, res["lr_schedule"]), rel=1e-9), f"step {t}: lr {lr}"


def readme_excerpt() -> str:
    """The part of scripts/own_loop.py between its `# >>> README` and `# <<< README` lines, dedented."""
    lines = (ROOT / SCRIPT).read_text().splitlines(keepends=True)
    begin = next(i for i, line in enumerate(lines) if line.strip().startswith("# >>> README"))
    end = next(i for i, line in enumerate(lines) if line.strip().startswith("# <<< README"))
    return textwrap.dedent("".join(lines[begin + 1:end]))


# --- CPU ------------------------------------------------------------------------------------------

SMALL = ["--context", "32", "--micro-batch", "8", "--log-every", "10", "--eval-every", "15"]  # a quick run


@pytest.mark.fast
def test_the_readme_shows_the_scripts_loop_verbatim():
    excerpt = readme_excerpt()
    assert "graphing.GraphedStep(" in excerpt and "graphing.micro_batches(" in excerpt  # the essential loop
    assert f"```python\n{excerpt}```" in (ROOT / "docs" / "own_loop.md").read_text(), (
        "docs/own_loop.md's code block differs from scripts/own_loop.py's README part; paste this:\n" + excerpt)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The loop on 2 gloo ranks without CUDA, three launches together: the model in DDP ("ddp"), sharded with
    FSDP2 ("fsdp2", --fsdp2), and asking for a graph ("full", --mode full): {name: (the launch, its output file)}."""
    folder = tmp_path_factory.mktemp("own_loop")
    # No --mode: without CUDA the default is eager.
    args = {"ddp": ["--steps", "30", *SMALL],
            "fsdp2": ["--fsdp2", "--steps", "30", *SMALL],
            "full": ["--mode", "full", "--steps", "20", *SMALL]}
    done = launch_together({name: [*a, "--output", str(folder / f"{name}.json")] for name, a in args.items()},
                           script=SCRIPT, nproc=2, env=NO_GPU, timeout=240)
    return {name: (proc, folder / f"{name}.json") for name, proc in done.items()}


def test_two_ranks_without_cuda_run_the_loop_eagerly_and_learn(two_ranks):
    proc, output = two_ranks["ddp"]
    res = results_of(proc, output)

    assert (res["mode"], res["world_size"], res["device"], res["steps"], res["accum"]) == ("eager", 2, "cpu", 30, 2)
    assert res["info"]["mode"] == "eager" and res["info"]["capture_error_mode"] is None
    digests = res["param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], f"ranks disagree on the parameters: {digests}"

    losses = res["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) and x > 0 for x in losses)  # every step wrote its slot
    assert losses[0] == pytest.approx(math.log(64), abs=0.1)  # an untrained model: uniform over the vocabulary
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, f"loss did not fall: first five {first:.4f}, last five {last:.4f}"
    assert_lr_schedule_followed(res)

    # The job's means, read once per log interval; evaluation outside the step at steps 15 and 30.
    logged = [(entry["step"], entry["phase"]) for entry in res["logged"]]
    assert logged == [(10, "warmup"), (20, "eager"), (30, "eager")]  # 11 warm-up steps, then eager (no GPU)
    assert all(0 < entry["loss"] < 4.5 and 0 < entry["grad_norm"] < 100 for entry in res["logged"])
    assert res["logged"][-1]["loss"] < res["logged"][0]["loss"] - 1.0
    assert [entry["step"] for entry in res["evaluated"]] == [15, 30]
    assert res["evaluated"][-1]["val_loss"] < 2.0

    assert proc.stdout.count("own_loop: mode=eager world_size=2") == 1, proc.stdout  # rank 0 speaks, once
    assert "step    30/30 | loss" in proc.stdout and "val loss" in proc.stdout and "on every rank" in proc.stdout


def test_two_ranks_sharded_with_fsdp2_learn_as_ddp_does_step_for_step(two_ranks):
    # The same run on 2 gloo ranks with the model sharded with FSDP2 (--fsdp2) instead of in DDP. fp32 on the
    # CPU, the same data and initial weights: the losses differ only by the order in which gradients are
    # summed (DDP's all-reduce, FSDP2's reduce-scatter), a few ulps.
    proc, output = two_ranks["fsdp2"]
    fsdp2 = results_of(proc, output)
    assert "own_loop: mode=eager world_size=2 fsdp2" in proc.stdout and "on every rank" in proc.stdout, proc.stdout
    ddp = results_of(*two_ranks["ddp"])
    assert (ddp["fsdp2"], fsdp2["fsdp2"]) == (False, True)
    assert (fsdp2["mode"], fsdp2["world_size"], fsdp2["device"]) == ("eager", 2, "cpu")
    assert fsdp2["info"]["mode"] == "eager"
    digests = fsdp2["param_digests"]  # one digest of every rank's shards, which every rank returns
    assert len(digests) == 2 and digests[0] == digests[1], digests

    losses = fsdp2["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) and x > 0 for x in losses)
    assert losses[0] == pytest.approx(math.log(64), abs=0.1)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, f"loss did not fall: first five {first:.4f}, last five {last:.4f}"
    assert_lr_schedule_followed(fsdp2)

    assert losses == pytest.approx(ddp["losses"], rel=1e-5)
    assert [e["step"] for e in fsdp2["logged"]] == [e["step"] for e in ddp["logged"]] == [10, 20, 30]
    for mine, theirs in zip(fsdp2["logged"], ddp["logged"]):  # the job's means: both ranks' losses and norms
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    assert fsdp2["evaluated"][-1]["val_loss"] == pytest.approx(ddp["evaluated"][-1]["val_loss"], rel=1e-5)


def test_full_without_cuda_fails_once_with_graphings_message(two_ranks):
    proc, output = two_ranks["full"]  # 2 ranks; one rank's case is the same code, printing once
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert text.count("needs a CUDA GPU") == 1, text  # rank 0 only, however many ranks
    assert "mode=full needs a CUDA GPU but this machine has no usable CUDA GPU" in text
    assert 'own_loop.py", line' not in text, f"the script printed a traceback:\n{text}"  # torchrun's own may follow
    assert not output.exists()


# --- GPU ------------------------------------------------------------------------------------------

# bf16 autocast and fused AdamW, run eagerly with a float lr and replayed with the lr carried into
# the graph as a tensor (read as float32 by the fused kernel): the same kernels, but last-bit
# differences in the lr and in bf16 rounding grow over the steps. Relative, on losses of 0.8..4.2.
LOSS_RTOL = 2e-2
STEPS, WARMUP = 60, 11
LR_WARMUP = 30  # the capture (step 12) falls inside the lr warm-up: a frozen lr would stay at 0.4 of its peak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"))], ids=["1gpu", "2gpus"])
def test_full_matches_eager_step_for_step(tmp_path, nproc):
    runs = {}
    for mode in ("eager", "full"):
        output = tmp_path / f"{mode}.json"
        proc = run_own_loop(["--mode", mode, "--steps", str(STEPS), "--seed", "3", "--warmup-iters", str(WARMUP),
                             "--lr-warmup", str(LR_WARMUP), "--log-every", "20", "--eval-every", "30",
                             "--output", str(output)], nproc=None if nproc == 1 else nproc, timeout=300)
        runs[mode] = results_of(proc, output)
        print(proc.stdout, proc.stderr[-2000:])
    eager, full = runs["eager"], runs["full"]

    # full really graphed: one capture after the warm-up, replays from then on (a graph never goes back)
    assert full["info"]["mode"] == "full" and full["info"]["capture_error_mode"] == "global"
    assert full["info"]["train_capture_s"] > 0
    assert [entry["phase"] for entry in full["logged"]] == ["graph"] * 3
    assert eager["info"]["mode"] == "eager" and "train_capture_s" not in eager["info"]
    assert [entry["phase"] for entry in eager["logged"]] == ["eager"] * 3
    for res in (eager, full):
        assert res["world_size"] == nproc and res["device"] == "cuda"
        assert len(set(res["param_digests"])) == 1, res["param_digests"]
        assert_lr_schedule_followed(res)

    rel = [abs(f - e) / e for e, f in zip(eager["losses"], full["losses"])]
    worst = max(range(STEPS), key=rel.__getitem__)
    print(f"nproc={nproc}: max relative |loss full - eager| = {rel[worst]:.2e} at step {worst + 1}; final losses "
          f"eager {eager['losses'][-1]:.4f} full {full['losses'][-1]:.4f}; val eager "
          f"{eager['evaluated'][-1]['val_loss']:.4f} full {full['evaluated'][-1]['val_loss']:.4f}")
    assert len(full["losses"]) == STEPS and rel[worst] < LOSS_RTOL
    assert full["losses"][-1] == pytest.approx(eager["losses"][-1], rel=LOSS_RTOL)
    assert full["evaluated"][-1]["val_loss"] == pytest.approx(eager["evaluated"][-1]["val_loss"], rel=LOSS_RTOL)
    # the comparison can fail: the loss moves far more over the run than the tolerance allows
    assert full["losses"][-1] < 0.5 * full["losses"][0]
