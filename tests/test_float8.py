"""train.float8 on the CPU, through torchao's emulation (train.float8_emulate=true: float8-rounded values
in plain matmuls): which layers the rule converts, two gloo ranks training under DDP and under FSDP2 with
its float8 all-gather, checkpoints that go from float8 runs to runs without it and back, each setting
that cannot work refused by name, and a torchao whose weight wrapper is not the tested one (stand-ins).

torchao is an optional extra (`pip install -r requirements-float8.txt`): these tests skip without it, save
the one that checks what a run says when it is missing. The graphed step on a GPU (real float8 matmuls,
the scales each replay reads) is tests/test_float8_gpu.py.
"""
from __future__ import annotations

import json
import math
import shutil
import sys

import pytest
import torch

from helpers.availability import needs_extra
from helpers.launches import launch, launch_together
from helpers.one_rank import group_of_one
from helpers.paths import ROOT
from trainer.checkpoint import list_checkpoints

# gpt_tiny's debug size, small enough for seconds on two CPU ranks: 8 steps of 2 x 8 windows of 32 tokens,
# two blocks of width 64 (each: qkv 64->192, proj 64->64, fc 64->256, proj 256->64; all divide by 16).
GPT = ["recipe=gpt_tiny", "recipe.model.n_layer=2", "recipe.model.n_head=2", "recipe.model.d_model=64",
       "recipe.model.context=32", "recipe.data.source=synthetic", "recipe.data.train_size=256",
       "recipe.data.test_size=64", "recipe.data.batch_size=8", "recipe.data.eval_batch_size=32",
       "train.max_steps=8", "train.epochs=1", "train.log_every=1", "train.precision=fp32", "train.grad_clip=1.0",
       "checkpoint.every_steps=4", "logger=none", "train.progress=false"]
FLOAT8 = ["train.float8=tensorwise", "train.float8_emulate=true"]
INSTALL = "pip install -r requirements-float8.txt"


def losses(run_dir) -> list:
    return [row["train/loss"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in row]


@pytest.mark.fast
def test_without_torchao_a_float8_run_says_how_to_install_it_before_anything_else(train_here, monkeypatch):
    # torchao made unimportable here, whether or not this machine has it; the run also asks for what float8
    # refuses on its own (a CPU without emulation, the all-gather under DDP with rowwise): the install comes first.
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)
    done = train_here([*GPT, "train.float8=rowwise", "train.fsdp.float8_all_gather=true"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count(INSTALL) == 1 and "torchao, which is not installed" in done.stderr, done.stderr
    assert "train.float8=none" in done.stderr and not list(done.output_root.rglob("metrics.jsonl"))


@pytest.mark.extras
@pytest.mark.fast
def test_the_rule_converts_the_linear_layers_inside_blocks_that_divide_by_16_and_no_other():
    needs_extra("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from trainer.parallel.float8 import Float8Spec, float8_layers

    class Block(torch.nn.Module):
        def __init__(self, embedding):
            super().__init__()
            self.up, self.odd, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(64, 40), torch.nn.Linear(128, 64)
            self.tied = torch.nn.Linear(64, 96, bias=False)
            self.tied.weight = embedding.weight  # shares its weight with a module outside: stays

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(96, 64)
            self.blocks = torch.nn.ModuleList(Block(self.embed) for _ in range(2))
            self.head = torch.nn.Linear(64, 96)  # outside the blocks: stays

    model = Model()
    taken = [name for name, _ in float8_layers(model, model.blocks)]
    assert taken == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]
    spec = Float8Spec(recipe="tensorwise", all_gather=False, emulate=True, compiled=False)
    weights = {name: p for name, p in model.named_parameters()}
    assert spec.convert(model, model.blocks, "handmade") == sorted(taken)
    converted = sorted(name for name, m in model.named_modules() if isinstance(m, Float8Linear))
    assert converted == sorted(taken) and model.blocks[0].tied.weight is model.embed.weight
    assert all(p is weights[name] for name, p in model.named_parameters())  # the same weights, converted in place
    from trainer.run.errors import ConfigError

    with pytest.raises(ConfigError, match="recipe 'plain' has no Linear layer float8 can take"):
        spec.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), [], "plain")  # no blocks: nothing to take


REFUSED = [
    pytest.param(["train.float8=tensorwise"], "needs a CUDA GPU of compute capability 8.9 or newer", id="cpu"),
    pytest.param(["recipe=mnist", *FLOAT8], "recipe 'mnist' has no Linear layer float8 can take", id="mnist"),
    pytest.param(["recipe=cifar10_resnet18", *FLOAT8], "recipe 'cifar10_resnet18' has no Linear layer float8 can "
                 "take", id="cifar10"),
    pytest.param([*FLOAT8, "train.fsdp.float8_all_gather=true"], "train.fsdp.float8_all_gather=true is a setting of "
                 "train.parallel=fsdp2, but this run uses train.parallel=ddp", id="all-gather-under-ddp"),
    pytest.param(["train.float8=rowwise", "train.float8_emulate=true", "train.parallel=fsdp2",
                  "train.fsdp.float8_all_gather=true"], "which train.float8=rowwise does not use", id="rowwise-gather"),
    pytest.param(["train.parallel=fsdp2", "train.fsdp.float8_all_gather=true"], "but train.float8=none",
                 id="gather-without-float8"),
    pytest.param(["train.float8_emulate=true"], "train.float8_emulate=true emulates float8 matmuls, but "
                 "train.float8=none", id="emulate-without-float8"),
]


@pytest.mark.extras
@pytest.mark.fast
@pytest.mark.parametrize("overrides, message", REFUSED)
def test_what_float8_cannot_carry_is_refused_by_name_before_any_training(train_here, overrides, message):
    needs_extra("torchao")
    base = ["experiment=debug", "logger=none"] if any(o.startswith("recipe=") for o in overrides) else GPT
    done = train_here([*base, *overrides])
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count(message) == 1, done.stderr[-3000:]
    assert not list(done.output_root.rglob("metrics.jsonl"))


@pytest.mark.extras
@pytest.mark.fast
def test_emulation_with_compile_is_refused_for_the_gpu_runs_that_could_ask_for_it():
    # graph.compile_model runs on a GPU only, where the plan asks the same function with compiled=True.
    needs_extra("torchao")
    from conf.schema import compose
    from trainer.parallel.float8 import float8_spec
    from trainer.run.errors import ConfigError

    cfg = compose([*GPT, *FLOAT8])
    assert float8_spec(cfg, torch.device("cpu"), "fp32", compiled=False).emulate
    with pytest.raises(ConfigError, match="train.float8_emulate=true is torchao's emulation for tests, eager only"):
        float8_spec(cfg, torch.device("cpu"), "fp32", compiled=True)


@pytest.fixture(scope="module")
def float8_runs(tmp_path_factory):
    """The same GPT, two gloo ranks each: without float8 (DDP), with it under DDP, and under FSDP2 with its
    float8 all-gather (weights gathered in float8, their scales computed at the start of each step)."""
    needs_extra("torchao")
    root = tmp_path_factory.mktemp("float8")
    runs = launch_together({"plain": GPT, "ddp": [*GPT, *FLOAT8],
                            "fsdp2": [*GPT, *FLOAT8, "train.parallel=fsdp2", "train.fsdp.float8_all_gather=true"]},
                           root, nproc=2, timeout=240)
    for run in runs.values():
        assert run.returncode == 0, run.output[-3000:]
    return runs


@pytest.mark.extras
def test_float8_trains_on_two_ranks_under_ddp_and_under_fsdp2_with_its_float8_all_gather(float8_runs):
    plain, ddp, fsdp2 = float8_runs["plain"], float8_runs["ddp"], float8_runs["fsdp2"]
    assert "float8 (tensorwise, emulated): 8 Linear layers of the recipe's blocks; the rest in fp32" in ddp.output
    assert "float8 (tensorwise, emulated, float8 all-gather): 8 Linear layers" in fsdp2.output
    assert "WARNING: train.fsdp.float8_all_gather" not in fsdp2.output  # this torchao's wrapper: the cast once a step
    for run in (ddp, fsdp2):
        assert len(losses(run.run_dir)) == 8 and all(math.isfinite(x) for x in losses(run.run_dir))
        assert losses(run.run_dir)[-1] < losses(run.run_dir)[0]
    # The matmuls are float8's: not the run without it, step for step; yet close to it.
    assert losses(ddp.run_dir) != losses(plain.run_dir)
    assert losses(ddp.run_dir) == pytest.approx(losses(plain.run_dir), rel=0.05)
    # FSDP2 gathers each weight cast with one scale from the whole weight's maximum (precomputed for all weights
    # at the start of each step): the very cast DDP's layers make of their whole weights, so the two runs agree to
    # fp32 rounding (reductions add in another order), as bf16's DDP and FSDP2 runs do (tests/test_fsdp_training.py).
    assert losses(fsdp2.run_dir) == pytest.approx(losses(ddp.run_dir), rel=1e-4)


@pytest.mark.extras
def test_a_float8_checkpoint_resumes_bit_for_bit_and_its_weights_cross_to_runs_without_float8_and_back(
        float8_runs, train_here, tmp_path):
    plain, fsdp2 = float8_runs["plain"], float8_runs["fsdp2"]
    # Resumed from its step-4 checkpoint at the same world size, the float8 FSDP2 run retraces steps 5-8 exactly.
    run_dir = tmp_path / "resumed"
    shutil.copytree(fsdp2.run_dir, run_dir)
    shutil.rmtree(list_checkpoints(run_dir)[-1])  # step 8's: the run resumes at step 4
    for name in ("results.json", "metrics.jsonl"):
        (run_dir / name).unlink()
    again = launch([*GPT, *FLOAT8, "train.parallel=fsdp2", "train.fsdp.float8_all_gather=true", f"run_dir={run_dir}"],
                   nproc=2, timeout=180)
    assert again.returncode == 0, again.output[-3000:]
    assert "resumed from" in again.output and losses(run_dir) == losses(fsdp2.run_dir)[4:]
    assert json.loads((run_dir / "results.json").read_text())["param_digests"] == fsdp2.results()["param_digests"]

    # The weights are the same high-precision tensors with float8 or without: a float8 checkpoint starts a run
    # without it (DDP, one rank) and a checkpoint without float8 starts a float8 run, each on the same weights.
    for source, into, extra in ((fsdp2, "plain", []), (plain, "float8", [*FLOAT8, "train.parallel=fsdp2",
                                                                          "train.fsdp.float8_all_gather=true"])):
        evaluated = train_here([*GPT, *extra, "train.eval_only=true",
                                f"checkpoint.init_from={list_checkpoints(source.run_dir)[-1]}"], tmp_path / into)
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        result = json.loads(next((tmp_path / into).rglob("eval.json")).read_text())
        assert result["param_digests"][0] == source.results()["param_digests"][0]
        assert result["final/eval_loss"] == pytest.approx(source.results()["final/eval_loss"], rel=0.05)


@pytest.fixture
def one_gloo_rank():
    with group_of_one("gloo"):
        yield


def _sharded_float8_mlp(seed: int):
    """Two blocks converted to float8 (emulated) with FSDP2's float8 all-gather, sharded over a group of one."""
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                                      torch.nn.Linear(128, 64)) for _ in range(2)),
                                torch.nn.Linear(64, 1))
    convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn[:1] in "01",
                               config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    return model


@pytest.mark.extras
@pytest.mark.fast
@pytest.mark.parametrize("precompute_at, named", [("end", True), ("start", False)])
def test_the_doctor_names_float8_scales_a_users_step_sets_after_its_forward(one_gloo_rank, precompute_at, named):
    # A user's own loop: blocks converted to float8 (emulated) with FSDP2's float8 all-gather, sharded over a group of
    # one, torchao's scale precompute after the optimizer (torchtitan's place) or first in the step.
    needs_extra("torchao")
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    from graphing.doctor import diagnose

    model = _sharded_float8_mlp(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, x, y):
        if precompute_at == "start":
            precompute_float8_dynamic_scale_for_fsdp(model)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if precompute_at == "end":
            precompute_float8_dynamic_scale_for_fsdp(model)

    report = diagnose(step, model, optimizer, (torch.randn(16, 64), torch.randn(16, 1)), warmup_iters=3,
                      timing_steps=0, check_optimizer=False)
    found = [f for f in report.findings if f.kind == "float8_scales"]
    assert bool(found) == named, report.table()
    if named:
        assert found[0].effect == "wrong" and "precompute_float8_dynamic_scale_for_fsdp" in found[0].what
        assert "before the forward" in found[0].fix


@pytest.mark.extras
@pytest.mark.fast
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_hugging_face_model_converts_every_linear_layer_of_its_decoder_layers_and_trains(train_here, recipe):
    needs_extra("torchao")
    needs_extra("transformers")
    done = train_here(["recipe=hf_causal_lm", "experiment=debug", "logger=none", "train.max_steps=3",
                       "train.eval=false", "checkpoint.save=false", "train.precision=fp32",
                       f"train.float8={recipe}", "train.float8_emulate=true"])
    assert done.returncode == 0, done.stderr[-3000:]
    # The debug llama: 2 decoder layers of 7 projections each (every size divides by 16); embeddings and lm_head stay.
    assert f"float8 ({recipe}, emulated): 14 Linear layers of the recipe's blocks; the rest in fp32" in done.stdout
    assert all(math.isfinite(row["train/loss"]) for row in done.metrics() if "train/loss" in row)


@pytest.mark.extras
@pytest.mark.fast
def test_each_weight_is_cast_once_a_step_and_a_gather_sends_it_only_within_its_step(one_gloo_rank):
    # The step's float8 work under FSDP2's float8 all-gather (Float8Spec.step_hooks): first torchao's scales, then
    # every weight cast once (trainer/parallel/float8_cast.py), the casts dropped last; against torchao's scales
    # alone (each gather casting the weight itself).
    needs_extra("torchao")
    from trainer.parallel.float8 import Float8Spec
    from trainer.parallel.float8_cast import CAST

    spec = Float8Spec(recipe="tensorwise", all_gather=True, emulate=True, compiled=False)
    x, y = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)), torch.randn(16, 1)
    runs = {}
    for casts_once in (True, False):
        model = _sharded_float8_mlp(seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # fused: bumps no version counter
        before, after = spec.step_hooks(model)
        if not casts_once:
            before, after = before.args[0], lambda: None  # torchao's precompute alone
        losses, sent = [], []
        for _ in range(4):
            before()
            weight = model[0][0].weight  # a converted weight (DTensor), its local tensor FSDP2's all-gather input
            mesh = weight.device_mesh
            (gathered,), _ = weight._local_tensor.fsdp_pre_all_gather(mesh)
            cast = getattr(weight._local_tensor, CAST, None)
            sent.append(cast is not None and gathered is cast.data)
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            after()
            losses.append(loss.item())
        # After the step a gather (an evaluation between steps) casts the weight as it is now, bit for bit what
        # torchao's own pre-all-gather makes, not the step's cast of the weight before the optimizer moved it.
        (now,), _ = weight._local_tensor.fsdp_pre_all_gather(mesh)
        (own,), _ = type(weight._local_tensor).fsdp_pre_all_gather(weight._local_tensor, mesh)
        assert torch.equal(now.view(torch.uint8), own.view(torch.uint8))
        if casts_once:
            assert getattr(weight._local_tensor, CAST) is None
            assert not torch.equal(now.view(torch.uint8), cast.data.view(torch.uint8))  # the weights moved
        runs[casts_once] = losses, sent
    assert runs[True][1] == [True] * 4 and runs[False][1] == [False] * 4
    assert runs[True][0] == runs[False][0]  # the same float8 bytes gathered: the same training, bit for bit


def _weight_wrapper_stand_ins():
    """torch.Tensor subclasses standing in for torchao's float8 weight wrapper (WeightWithDynamicFloat8CastTensor):
    as 0.17 and 0.18 have it, one without ``_dtype``, one whose hook takes FSDP2's five-argument form."""

    class Wrapper(torch.Tensor):
        def fsdp_pre_all_gather(self, mesh):
            return (self._tensor,), (self._precomputed_scale,)

    class WithoutDtype(Wrapper):
        pass

    class FiveArgumentHook(Wrapper):
        def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
            return super().fsdp_pre_all_gather(mesh)

    made = {}
    for cls in (Wrapper, WithoutDtype, FiveArgumentHook):
        local = torch.Tensor._make_subclass(cls, torch.zeros(4, 4))
        local._tensor, local._precomputed_scale = torch.zeros(4, 4), None
        if cls is not WithoutDtype:
            local._dtype = torch.float8_e4m3fn
        made[cls.__name__] = local
    return made


@pytest.mark.fast
def test_a_torchao_weight_wrapper_unlike_the_tested_ones_is_told_apart_by_what_it_lacks():
    # The cast once a step reads private names of torchao's weight wrapper (trainer/parallel/float8_cast.py); a torchao
    # that renamed one, or moved its hook to FSDP2's newer form, must not be read as if it had them.
    from trainer.parallel.float8_cast import TESTED_TORCHAO, wrapper_lacks

    stand_ins = _weight_wrapper_stand_ins()
    assert wrapper_lacks(stand_ins["Wrapper"]) == []
    assert wrapper_lacks(stand_ins["WithoutDtype"]) == ["attribute _dtype"]
    assert wrapper_lacks(stand_ins["FiveArgumentHook"]) == ["fsdp_pre_all_gather(self, mesh)"]
    assert wrapper_lacks(torch.zeros(4, 4)) == []  # a weight FSDP2 gathers as it is
    # The range the check was tested over is the one the requirements install.
    requirements = (ROOT / "requirements-float8.txt").read_text().splitlines()
    pinned = [line for line in requirements if line.startswith("torchao")]
    assert pinned == [f"torchao{TESTED_TORCHAO}"]


def _with_five_argument_hook(wrapper: type) -> type:
    """torchao's weight wrapper class as a later torchao might have it: its pre-all-gather in FSDP2's newer form."""

    class LaterWrapper(wrapper):
        def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
            return wrapper.fsdp_pre_all_gather(self, mesh)

    return LaterWrapper


@pytest.mark.extras
@pytest.mark.fast
def test_a_torchao_with_another_weight_wrapper_gathers_through_its_own_cast_and_says_so_once(one_gloo_rank, capsys):
    # The tested torchao's wrappers pass the check; a later one (stood in for by torchao's own class with the
    # five-argument hook FSDP2 also takes) falls back to torchao's gathers with one warning, and trains the same.
    needs_extra("torchao")
    from trainer.parallel.float8 import Float8Spec
    from trainer.parallel.float8_cast import CAST, WeightCasts

    spec = Float8Spec(recipe="tensorwise", all_gather=True, emulate=True, compiled=False)
    x, y = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)), torch.randn(16, 1)
    runs = {}
    for later_torchao in (False, True):
        model = _sharded_float8_mlp(seed=0)
        assert WeightCasts(model, compiled=False).surface_differs() is None  # this machine's torchao: as tested
        wrapped = [p._local_tensor for p in model.parameters() if hasattr(type(p._local_tensor), "fsdp_pre_all_gather")]
        assert wrapped
        if later_torchao:
            for local in wrapped:
                local.__class__ = _with_five_argument_hook(type(local))
        capsys.readouterr()
        before, after = spec.step_hooks(model)
        warned = capsys.readouterr().out
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        losses = []
        for _ in range(3):
            before()
            assert all(getattr(local, CAST, None) is None for local in wrapped) == later_torchao
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            if after is not None:
                after()
            losses.append(loss.item())
        runs[later_torchao] = losses, after, warned
    assert runs[False][1] is not None and runs[False][2] == ""
    losses, after, warned = runs[True]
    assert after is None and warned.count("WARNING") == 1
    assert "LaterWrapper lacks fsdp_pre_all_gather(self, mesh)" in warned and "tested: torchao>=0.17,<0.19" in warned
    assert "pip install -r requirements-float8.txt" in warned
    assert losses == runs[False][0]  # torchao's own gathers send the same float8 bytes: the same training
