"""train.precision=fp16 on the CPU side: the refusals, the settings, and the loss scale in checkpoints.

fp16 itself runs on GPUs only (tests/test_precision_gpu.py: graphed equals eager, overflow skipped
and the scale halved inside the graph, growth, resume).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from trainer.run.errors import ConfigError


@pytest.mark.fast
def test_fp16_on_a_machine_without_cuda_is_one_message_naming_the_setting(train_here):
    done = train_here(["train.precision=fp16", "recipe.data.source=synthetic", "logger=none", "device=cpu"])
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert text.count("train.precision=fp16 needs a CUDA GPU") == 1, text[-3000:]
    assert "set train.precision=bf16 or fp32" in text and "Traceback" not in text
    assert not done.output_root.exists()


@pytest.mark.fast
def test_a_loss_scale_that_cannot_work_is_named():
    from conf.schema import compose
    from trainer.plan import plan_run

    for override in ("train.loss_scale.init=0", "train.loss_scale.growth_interval=0"):
        with pytest.raises(ConfigError, match=r"train.loss_scale.init=.* must be > 0 and train.loss_scale.growth"):
            plan_run(compose([override]), torch.device("cpu"), 1)


@pytest.mark.fast
def test_under_a_graph_fp16_needs_an_optimizer_that_takes_the_scale_on_the_device():
    from trainer.step.optim import build_optimizer
    from trainer.step.optim import optimizer_spec

    def spec(target, **settings):
        return optimizer_spec(OmegaConf.create({"_target_": target, "_partial_": True, "lr": 0.1, **settings}))

    cpu = torch.device("cpu")  # only the classes' flags are read here; nothing steps
    rmsprop = spec("torch.optim.RMSprop", capturable=True)  # capturable, but not fused: the scaler syncs
    with pytest.raises(ConfigError) as err:
        build_optimizer(rmsprop, torch.nn.Linear(2, 2).parameters(), cpu, captured=True, loss_scaled=True)
    assert "recipe.optim._target_=torch.optim.RMSprop with train.precision=fp16" in str(err.value)
    assert "train.precision=bf16, or graph=eager / graph=partial" in str(err.value)
    build_optimizer(rmsprop, torch.nn.Linear(2, 2).parameters(), cpu, captured=False, loss_scaled=True)  # eager: ok
    fused = spec("torch.optim.AdamW", fused=True, capturable=True)
    optimizer = build_optimizer(fused, torch.nn.Linear(2, 2).parameters(), cpu, captured=True, loss_scaled=True)
    assert optimizer._step_supports_amp_scaling


@pytest.mark.fast
def test_the_loss_scale_and_its_growth_tracker_are_saved_and_restored(tmp_path):
    from trainer.run.runtime import Runtime
    from trainer.checkpoint import TrainingState
    from trainer.parallel.parallelism import DDPSpec, Parallelism

    def state_with(scaler):
        rt = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False,
                     run_dir=Path(tmp_path))
        model = torch.nn.Linear(2, 1)
        return TrainingState(rt, model=model, parallelism=Parallelism(DDPSpec(kwargs={}, comm_hook=None)),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             step_counter=torch.zeros((), dtype=torch.int64), recipe_name="r", config={}, seed=0,
                             keep=2, scaler=scaler)

    saved = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    for overflow in (False, True, False):  # one good step, an overflow (scale halves), a good step
        optimizer.zero_grad()
        saved.scale((params[0] * (float("inf") if overflow else 1.0)).sum()).backward()
        saved.step(optimizer)
        saved.update()
    assert saved.get_scale() == 512.0 and saved._get_growth_tracker() == 1
    state_with(saved).save(step=3, epoch=0, wandb_run_id=None)
    restored = torch.amp.GradScaler("cpu", init_scale=65536.0, growth_interval=3)
    state_with(restored).restore("auto")
    restored.scale(torch.ones(()))  # the scale is made lazily, from the restored values
    assert restored.get_scale() == 512.0 and restored._get_growth_tracker() == 1
