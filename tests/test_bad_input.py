"""Every bad input gets one clear message naming the setting, a non-zero exit, nothing half-written.

| input                                          | exit | message names                          |
|------------------------------------------------|------|----------------------------------------|
| recipe=nope                                    | 1    | Could not find 'recipe/nope'           |
| train.epochz=3 (typo), train.epochs=many       | 1    | the key (Hydra, compose time)          |
| graph.capture_error_mode=sometimes (any Enum)  | 1    | the key and the choices (compose time) |
| graph=full on a machine without CUDA           | 2    | graph.mode=full needs a CUDA GPU       |
| warmup_iters below 11 under DDP                | 2    | graph.warmup_iters                     |
| batch larger than a rank's shard               | 2    | recipe.data.batch_size                 |
| data.source=mnist offline, no files            | 2    | recipe.data.source / recipe.data.root  |
| unwritable output directory                    | 2    | output_root / run_dir                  |
| zero or negative sizes                         | 2    | the key                                |
| train.ddp.bucket_cap_mb=0                      | 2    | train.ddp.bucket_cap_mb                |
| DDP's static_graph with gradient accumulation  | 2    | train.ddp.static_graph                 |
| recipe/optimizer/schedule _target_ not found   | 2    | the _target_ key                       |
| an optimizer argument the class does not take  | 2    | recipe.optim.<key>                     |
| a host-side LR scheduler                       | 2    | recipe.schedule._target_               |
| an optimizer a graph would freeze (full mode)  | 2    | recipe.optim._target_ / .capturable    |
| an optimizer whose step needs a closure (LBFGS)| 2    | recipe.optim._target_ (any graph mode) |
| a dataset item not (x, y) nor a dict of fields | 2    | recipe._target_ (test_several_inputs)  |
| device=cuda without CUDA                       | 2    | device                                 |

The messages are checked in one process (fast); that each is printed once under
torchrun, with torchrun's exit status and no run directory left, is checked on a few
representative cases in tests/test_fault_table.py (Hydra's, ours, mnist offline, an
unwritable output directory).
"""
from __future__ import annotations

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conf.schema import compose
from graphing import GraphMode
from trainer.run.errors import ConfigError

QUICK = ["recipe.data.source=synthetic", "recipe.data.train_size=2048", "recipe.data.test_size=256",
         "logger=none", "train.max_steps=2"]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message seen without CUDA")

CASES = [
    pytest.param(["graph=full"], ["graph.mode=full needs a CUDA GPU", "graph.mode=eager"], id="graph-without-cuda",
                 marks=no_cuda),
    pytest.param(["device=cuda"], ["device=cuda", "device=auto"], id="cuda-device-without-cuda", marks=no_cuda),
    pytest.param(["recipe.data.batch_size=5000"], ["asks for 5000 samples per step on each rank",
                                                   "lower recipe.data.batch_size"], id="batch-larger-than-shard"),
    pytest.param(["train.epochs=0"], ["train.epochs=0 must be at least 1"], id="zero-epochs"),
    pytest.param(["recipe.data.batch_size=-4"], ["recipe.data.batch_size=-4"], id="negative-batch"),
    pytest.param(["checkpoint.keep=0"], ["checkpoint.keep=0 must be at least 1"], id="keep-zero"),
    pytest.param(["checkpoint.resume=/no/such/file.pt"], ["checkpoint.resume='/no/such/file.pt'"], id="resume-missing"),
    pytest.param(["recipe.optim._target_=torch.optim.Lamb"],
                 ["recipe.optim._target_=torch.optim.Lamb: module torch.optim has no 'Lamb'"], id="unknown-optimizer"),
    pytest.param(["recipe.optim._target_=collections.OrderedDict"],
                 ["recipe.optim._target_='collections.OrderedDict' is not a torch.optim.Optimizer"], id="not-optimizer"),
    pytest.param(["recipe.optim._target_=torch.optim.AdamW"],
                 ["recipe.optim.momentum is not an argument of torch.optim.AdamW", "~recipe.optim.momentum"],
                 id="optimizer-argument"),
    pytest.param(["recipe.optim.lr=-1"], ["recipe.optim.lr=-1 must be a positive number"], id="negative-lr"),
    pytest.param(["recipe.optim._target_=torch.optim.LBFGS"],  # mnist's momentum key too: the closure is named first
                 ["recipe.optim._target_=torch.optim.LBFGS cannot be used", "step needs a closure",
                  "set recipe.optim._target_=torch.optim.AdamW"], id="closure-optimizer"),
    pytest.param(["recipe._target_=my_missing_package.recipe.build"],
                 ["recipe._target_=my_missing_package.recipe.build cannot be imported", "PYTHONPATH"],
                 id="unknown-recipe-target"),
    pytest.param(["recipe._target_=os.getcwd"], ["recipe._target_=os.getcwd cannot be called as build(cfg, runtime)"],
                 id="recipe-target-wrong-signature"),
    pytest.param(["recipe._target_=operator.is_"], ["recipe._target_=operator.is_ returned a bool, not a "
                                                    "trainer.recipe.Recipe"], id="recipe-target-not-a-recipe"),
    pytest.param(["recipe.schedule._target_=torch.optim.lr_scheduler.StepLR"],
                 ["is a host-side scheduler", "trainer.step.schedules.Cosine"], id="host-side-scheduler"),
    pytest.param(["recipe.schedule._target_=trainer.step.schedules.Cosine", "+recipe.schedule.min_lr_ratio=2"],
                 ["recipe.schedule (trainer.step.schedules.Cosine) could not be built", "min_lr_ratio=2"],
                 id="schedule-argument"),
    pytest.param(["graph.compile_model=true", "graph=eager"], ["graph.compile_model=true applies to graph.mode=full"],
                 id="compile-model-eager"),
    pytest.param(["recipe.data.seq_len_buckets=[8,16]"], ["recipe.data.seq_len_buckets=[8, 16] applies to language "
                                                          "models", "remove recipe.data.seq_len_buckets"],
                 id="seq-len-buckets-for-images"),
    pytest.param(["recipe.accuracy=false", "checkpoint.best_metric=eval/accuracy"],
                 ["checkpoint.best_metric=eval/accuracy needs the accuracy, but recipe.accuracy=false",
                  "set checkpoint.best_metric=eval/loss"], id="best-accuracy-without-accuracy"),
    pytest.param(["graph.compile_mode=max_autotune_no_cudagraphs"],
                 ["graph.compile_mode=max-autotune-no-cudagraphs applies to graph.compile_model=true"],
                 id="compile-mode-without-compile-model"),
    pytest.param(["graph.max_graphs=0"], ["graph.max_graphs=0 must be at least 1", "set graph.max_graphs=8"],
                 id="max-graphs-zero"),
    pytest.param(["train.ddp.bucket_cap_mb=0"], ["train.ddp.bucket_cap_mb=0.0 must be a positive number of MiB",
                                                 "or train.ddp.bucket_cap_mb=null for torch's default"],
                 id="ddp-bucket-zero"),
    pytest.param(["recipe.data.worker_timeout_s=0"], ["recipe.data.worker_timeout_s=0.0 must be a positive number of "
                                                      "seconds"], id="worker-timeout-zero"),
]


@pytest.mark.fast
@pytest.mark.parametrize("args,needles", CASES)
def test_bad_input_is_named_with_exit_code_2(train_here, args, needles):
    done = train_here([*QUICK, *args])
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert text.count(needles[0]) == 1, f"expected {needles[0]!r} exactly once in:\n{text[-3000:]}"
    for needle in needles[1:]:
        assert needle in text, text[-3000:]
    assert "Traceback" not in text
    assert not done.output_root.exists(), "a config error leaves no run directory behind"


@pytest.mark.fast
@pytest.mark.parametrize("args,needle", [
    (["recipe=nope"], "Could not find 'recipe/nope'"),
    (["train.epochz=3"], "Key 'epochz' not in 'TrainLoopConfig'"),
    (["train.epochs=many"], "could not be converted to Integer"),
    (["graph.capture_error_mode=sometimes"], "expected one of [global, thread_local, relaxed]"),
    (["recipe.data.worker_start=thread"], "expected one of [forkserver, spawn, fork]"),
])
def test_compose_time_errors_name_the_key(args, needle):
    with pytest.raises(ConfigCompositionException) as err:
        compose([*QUICK, *args])
    assert needle in str(err.value) + str(err.value.__cause__)


# ---- checks that depend on the machine or the world size, in one process -----------------

@pytest.mark.fast
def test_warmup_below_eleven_under_ddp_is_refused_with_the_reason():
    from trainer.plan import graph_options

    cuda = torch.device("cuda", 0)  # only the device type is read
    cfg = compose(["graph=full", "graph.warmup_iters=5"])
    with pytest.raises(ConfigError, match=r"graph.warmup_iters=5 is too few under DDP.*first 10 iterations"):
        graph_options(cfg, cuda, world_size=2)
    assert graph_options(cfg, cuda, world_size=1).warmup_iters == 5  # one process: no DDP bookkeeping
    assert graph_options(compose(["graph=full"]), cuda, world_size=2).mode is GraphMode.full
    with pytest.raises(ConfigError, match=r"graph.warmup_iters=5 is too few"):
        graph_options(compose(["graph=partial", "graph.warmup_iters=5"]), cuda, world_size=2)


@pytest.mark.fast
def test_ddp_static_graph_with_gradient_accumulation_is_refused_where_ddp_is_used():
    from trainer.plan import plan_run

    cpu = torch.device("cpu")
    cfg = compose(["train.ddp.static_graph=true", "train.grad_accum=2"])
    with pytest.raises(ConfigError, match=r"train.ddp.static_graph=true with train.grad_accum=2: .* under no_sync"):
        plan_run(cfg, cpu, world_size=2)
    one_process = plan_run(cfg, cpu, world_size=1).parallelism.data_parallel
    assert one_process.kwargs["static_graph"]  # one process: no DDP, nothing to refuse
    no_accumulation = plan_run(compose(["train.ddp.static_graph=true"]), cpu, world_size=2).parallelism.data_parallel
    assert no_accumulation.kwargs["static_graph"]


@pytest.mark.fast
def test_auto_mode_picks_full_on_cuda_and_eager_on_cpu():
    from trainer.plan import graph_options

    cfg = compose([])
    assert graph_options(cfg, torch.device("cuda", 0), 2).mode is GraphMode.full
    assert graph_options(cfg, torch.device("cpu"), 2).mode is GraphMode.eager


@pytest.mark.fast
@pytest.mark.parametrize("target,settings,needle", [
    ("torch.optim.Adagrad", {}, "torch.optim.adagrad.Adagrad has neither a capturable nor a fused CUDA mode"),
    ("torch.optim.AdamW", {"capturable": False}, "recipe.optim.capturable=false cannot run inside a CUDA graph"),
])
def test_an_optimizer_a_graph_would_freeze_is_refused_in_full_mode(target, settings, needle):
    # A setting is refused by the plan's check (check_captured_optimizer); a class, once built (build_optimizer).
    from trainer.step.optim import build_optimizer, check_captured_optimizer, optimizer_spec

    cfg = optimizer_spec(OmegaConf.create({"_target_": target, "_partial_": True, "lr": 0.1, **settings}))

    def plan_then_build(captured: bool):
        check_captured_optimizer(cfg, captured=captured)
        return build_optimizer(cfg, torch.nn.Linear(2, 2).parameters(), torch.device("cpu"), captured=captured)

    with pytest.raises(ConfigError) as err:
        plan_then_build(captured=True)
    assert needle in str(err.value) and "graph=eager" in str(err.value)
    plan_then_build(captured=False)  # eager: fine


class _Huge(torch.nn.Module):
    """A model whose forward runs out of device memory, as one too big for its GPU does."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")


def too_big(cfg, runtime):
    """A user's recipe (``recipe._target_=test_bad_input.too_big``) whose model does not fit."""
    from trainer.recipe import Datasets, Recipe, Split, top1_correct

    x = torch.randn(64, 2)
    split = Split(x, (x[:, 0] > 0).long())
    return Recipe(name=cfg.recipe.name, model=_Huge(), data=Datasets(split, split, "points"),
                  preprocess=lambda batch, train: batch, criterion=torch.nn.functional.cross_entropy,
                  correct=top1_correct)


@pytest.mark.fast
def test_running_out_of_gpu_memory_says_so_in_one_line_with_the_settings_to_change(train_here):
    done = train_here(["recipe._target_=test_bad_input.too_big", "recipe.name=too_big", "logger=none",
                       "train.max_steps=2"])
    assert done.returncode == 1
    said = done.stderr.strip().splitlines()
    assert len(said) == 1 and "out of GPU memory (OutOfMemoryError: CUDA out of memory" in said[0], done.stderr
    assert "train.parallel=fsdp2" in said[0] and "recipe.data.batch_size" in said[0]
    assert "Traceback" not in done.stderr


@pytest.mark.fast
def test_every_exit_code_has_one_meaning():
    """trainer/run/errors.py and the doctor's verdicts (graphing's): no value means two things."""
    from graphing.doctor.report import VERDICT_EXIT
    from trainer.run.errors import TRAINER_EXIT_CODES

    doctor = {f"doctor: {verdict}": code for verdict, code in VERDICT_EXIT.items() if verdict != "ready"}
    codes = {**TRAINER_EXIT_CODES, **doctor}
    assert VERDICT_EXIT["ready"] == TRAINER_EXIT_CODES["done"] == 0
    assert len(set(codes.values())) == len(codes), codes
