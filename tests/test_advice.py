"""A refused setting's message proposes a change: typed as the message words it, it gets the run past the plan.

Each case is what a user typed, the words the refusal must say, and each change its message proposes, as
edits to that command line: ``key=value`` (set, or replace what was typed for key), ``~key`` (Hydra's
deletion) and ``drop key`` (take back what was typed for key). Every edit must appear in the message
verbatim (a change of several edits as one run of text, the whole change in one place), and the command
with the edits applied must pass the plan (trainer/plan.py ``plan_run``). The plan reads only a device's
type, so the GPU's cases plan here too.
"""
from __future__ import annotations

import re

import pytest
import torch

from conf.schema import compose
from trainer.plan import plan_run
from trainer.run.errors import ConfigError

pytestmark = pytest.mark.fast

NEW_DIRECTORY = "<a new directory>"  # a message's placeholder; the test types a directory that does not exist

# (what the user typed, the refusal's words, device, world size, the changes it proposes: each a list of edits)
CASES = {
    "worker timeout": (["recipe.data.worker_timeout_s=0"], "recipe.data.worker_timeout_s=0.0 must be", "cpu", 1,
                       [["recipe.data.worker_timeout_s=300"]]),
    "label smoothing": (["recipe.label_smoothing=1"], "recipe.label_smoothing=1.0 must be", "cpu", 1,
                        [["recipe.label_smoothing=0.1"]]),
    "bucket size": (["train.ddp.bucket_cap_mb=0"], "train.ddp.bucket_cap_mb=0.0 must be", "cpu", 2,
                    [["train.ddp.bucket_cap_mb=25"], ["train.ddp.bucket_cap_mb=null"]]),
    "resume": (["checkpoint.resume=no/such/checkpoint.pt"], "is neither auto", "cpu", 1, [["checkpoint.resume=auto"]]),
    "init_from": (["checkpoint.init_from=no/such/checkpoint.pt"], "is not a checkpoint", "cpu", 1,
                  [["drop checkpoint.init_from"]]),
    "export exists": (["checkpoint.export={taken}"], "exists: it holds a directory that no run's export wrote", "cpu",
                      1, [[f"checkpoint.export={NEW_DIRECTORY}"]]),
    "best.pt unsaved": (["checkpoint.save=false", "checkpoint.best_metric=eval/loss"], "checkpoint.save=false writes "
                        "no checkpoint", "cpu", 1, [["drop checkpoint.best_metric"], ["checkpoint.save=true"]]),
    "best accuracy uncounted": (["recipe.accuracy=false", "checkpoint.best_metric=eval/accuracy"],
                                "needs the accuracy", "cpu", 1,
                                [["checkpoint.best_metric=eval/loss"], ["recipe.accuracy=true"]]),
    "export dtype alone": (["checkpoint.export_dtype=bf16"], "checkpoint.export_dtype=bf16 is read only with "
                           "checkpoint.export", "cpu", 1,
                           [["drop checkpoint.export_dtype"], [f"checkpoint.export={NEW_DIRECTORY}"]]),
    "checkpoint interval unsaved": (["checkpoint.save=false", "checkpoint.every_steps=5"], "checkpoint.every_steps=5 "
                                    "is read only with checkpoint.save=true", "cpu", 1,
                                    [["drop checkpoint.every_steps"], ["checkpoint.save=true"]]),
    "worker start without workers": (["recipe.data.worker_start=spawn"], "recipe.data.worker_start=spawn is read "
                                     "only with recipe.data.num_workers above 0", "cpu", 1,
                                     [["drop recipe.data.worker_start"], ["recipe.data.num_workers=2"]]),
    "compare steps alone": (["graph.compare_steps=50"], "graph.compare_steps=50 is read only with graph.compare=true",
                            "cuda", 1, [["drop graph.compare_steps"], ["graph.compare=true"]]),
    "compare without a graph": (["graph.compare=true"], "graph.compare=true times eager steps", "cpu", 1,
                                [["drop graph.compare"]]),
    "compare eager": (["graph=eager", "graph.compare=true"], "resolves to eager", "cuda", 1,
                      [["graph=full"], ["drop graph.compare"]]),
    "fp16 on the cpu": (["train.precision=fp16"], "train.precision=fp16 needs a CUDA GPU", "cpu", 1,
                        [["train.precision=bf16"]]),
    "loss scale without fp16": (["train.loss_scale.init=1024"], "applies to train.precision=fp16 only", "cuda", 1,
                                [["drop train.loss_scale.init"], ["train.precision=fp16"]]),
    # a recipe's own settings for the other parallel mode are its business; only what the user typed is refused
    "fsdp setting under ddp": (["recipe=gpt_1b", "train.parallel=ddp", "train.fsdp.init=meta"],
                               "train.fsdp.init=meta is a setting of train.parallel=fsdp2", "cpu", 1,
                               [["drop train.fsdp.init"], ["train.fsdp.init=host"], ["train.parallel=fsdp2"]]),
    "ddp setting under fsdp2": (["recipe=gpt_1b", "train.ddp.grad_reduce=bf16"],
                                "train.ddp.grad_reduce=bf16 is a setting of train.parallel=ddp", "cpu", 1,
                                [["drop train.ddp.grad_reduce"], ["train.ddp.grad_reduce=fp32"],
                                 ["train.parallel=ddp"]]),
    "static graph with accumulation": (["train.ddp.static_graph=true", "train.grad_accum=2"], "under no_sync", "cpu",
                                       2, [["train.ddp.static_graph=false"], ["train.grad_accum=1"]]),
    "fp16 under fsdp2": (["recipe=gpt_tiny", "train.parallel=fsdp2", "train.precision=fp16"],
                         "train.precision=fp16 with train.parallel=fsdp2", "cuda", 2,
                         [["train.precision=bf16"], ["train.parallel=ddp"]]),
    "partial graphs under fsdp2": (["recipe=gpt_tiny", "train.parallel=fsdp2", "graph=partial"], "graph=partial with "
                                   "train.parallel=fsdp2", "cuda", 2, [["graph=full"], ["graph=eager"]]),
    "bf16 reduction of fp32": (["train.parallel=fsdp2", "train.fsdp.reduce_dtype=bf16"], "reduces bf16 gradients",
                               "cpu", 2, [["train.precision=bf16"], ["train.fsdp.reduce_dtype=fp32"]]),
    # SGD captured on shards: the whole change to AdamW in one place (mnist's and cifar's SGD keys AdamW lacks)
    "mnist sgd captured on shards": (["train.parallel=fsdp2", "graph=full"], "torch's DTensor has no fused SGD",
                                     "cuda", 2,
                                     [["recipe.optim._target_=torch.optim.AdamW", "~recipe.optim.momentum",
                                       "recipe.optim.lr=0.001"], ["graph=eager"], ["train.parallel=ddp"]]),
    "cifar sgd captured on shards": (["recipe=cifar10_resnet18", "train.parallel=fsdp2", "graph=full"],
                                     "torch's DTensor has no fused SGD", "cuda", 2,
                                     [["recipe.optim._target_=torch.optim.AdamW", "~recipe.optim.momentum",
                                       "~recipe.optim.nesterov", "recipe.optim.lr=0.001"], ["graph=eager"],
                                      ["train.parallel=ddp"]]),
    "float8 gather without float8": (["train.parallel=fsdp2", "train.fsdp.float8_all_gather=true"],
                                     "gathers float8 weights, but train.float8=none", "cpu", 2,
                                     [["drop train.fsdp.float8_all_gather"]]),
    "float8 emulation without float8": (["train.float8_emulate=true"], "emulates float8 matmuls, but "
                                        "train.float8=none", "cpu", 1, [["drop train.float8_emulate"]]),
}


def key_of(override: str) -> str:
    return re.split(r"[=]", override.lstrip("+~"), maxsplit=1)[0]


def apply(typed: list, edits: list, fill: dict) -> list:
    """``typed`` with ``edits`` applied, as a user would retype the command line."""
    args = list(typed)
    for edit in edits:
        if edit.startswith("drop "):
            args = [a for a in args if key_of(a) != edit[len("drop "):]]
        elif edit.startswith("~"):
            args.append(edit)
        else:
            args = [a for a in args if key_of(a) != key_of(edit)] + [edit.replace(NEW_DIRECTORY, fill["new"])]
    return args


@pytest.mark.parametrize("name", list(CASES))
def test_a_refusals_advice_typed_as_written_passes_the_plan(name, tmp_path):
    typed, words, device, world_size, changes = CASES[name]
    fill = {"taken": str(tmp_path / "taken"), "new": str(tmp_path / "new")}
    (tmp_path / "taken").mkdir()
    typed = [a.format(**fill) for a in typed]
    device = torch.device(device, 0) if device == "cuda" else torch.device(device)  # the plan reads the type only

    with pytest.raises(ConfigError) as refused:
        plan_run(compose(typed), device, world_size)
    message = str(refused.value)
    assert words in message, message
    for edits in changes:
        assert " ".join(edits) in message, (edits, message)  # as written, the whole change in one place
        retyped = apply(typed, edits, fill)
        plan_run(compose(retyped), device, world_size)  # past the plan: no ConfigError
