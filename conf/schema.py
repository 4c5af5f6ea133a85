"""Typed schema of the training config.

Hydra merges conf/train.yaml and the chosen group files into these dataclasses, so a
mistyped key or a value of the wrong type fails at compose time with Hydra's own
message (``Key 'epochz' is not in struct``, ``Value 'abc' could not be converted to
Integer``). Checks that need more than a type (ranges, combinations, the machine)
live in ``validate_config`` in recipes/runtime.py and graphing/options.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


class GraphMode(Enum):
    auto = "auto"  # full on CUDA, eager on CPU
    eager = "eager"
    full = "full"  # the whole training step as one CUDA graph per rank
    partial = "partial"  # torch.cuda.make_graphed_callables on the model
    compile = "compile"  # torch.compile(mode="reduce-overhead")


class OnCaptureFailure(Enum):
    fail = "fail"
    eager = "eager"


class LoaderKind(Enum):
    device = "device"  # the whole dataset lives on the accelerator
    host = "host"  # DataLoader with pinned memory and non_blocking copies


class Precision(Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class LoggerBackend(Enum):
    wandb = "wandb"
    none = "none"


@dataclass
class DataConfig:
    source: str = "auto"  # each recipe lists what it accepts (mnist: auto|mnist|synthetic)
    root: str = "data"
    loader: LoaderKind = LoaderKind.device
    batch_size: int = 64  # per rank
    eval_batch_size: int = 1000  # per rank; the last batch is padded and masked
    num_workers: int = 0  # host loader only
    train_size: Optional[int] = None  # synthetic data only; None: the real set's size
    test_size: Optional[int] = None
    path: Optional[str] = None  # text recipes: a file to tokenize


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd | adam | adamw
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class ScheduleConfig:
    name: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class RecipeConfig:
    name: str = "mnist"
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    model: Dict[str, Any] = field(default_factory=dict)  # checked by the recipe's model
    label_smoothing: float = 0.0


@dataclass
class GraphConfig:
    mode: GraphMode = GraphMode.auto
    warmup_iters: int = 11  # DDP needs 11 eager iterations before capture
    capture_error_mode: str = "global"  # global | thread_local | relaxed
    compile_model: bool = False  # full mode: torch.compile(mode="default") inside the graph
    on_failure: OnCaptureFailure = OnCaptureFailure.fail
    compare: bool = False  # time eager steps, then graph steps, in this process
    compare_steps: int = 100


@dataclass
class TrainLoopConfig:
    epochs: int = 10
    max_steps: Optional[int] = None  # stop early after this many optimizer steps
    log_every: int = 50
    eval: bool = True  # evaluate on the whole test set after each epoch
    grad_clip: float = 0.0  # max global grad norm; 0 disables
    grad_accum: int = 1  # micro-batches per optimizer step, all inside one graph
    precision: Precision = Precision.fp32
    progress: bool = True  # progress bar on rank 0


@dataclass
class WandbConfig:
    project: str = "graphed-ddp"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    job_type: Optional[str] = None  # default: the graph mode
    mode: Optional[str] = None  # offline | online | disabled; default WANDB_MODE, else offline
    all_ranks: bool = False  # one run per rank (grouped) instead of rank 0 only
    init_timeout_s: float = 60.0


@dataclass
class LoggerConfig:
    backend: LoggerBackend = LoggerBackend.wandb
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0: only at the end
    keep: int = 2
    resume: str = "auto"  # auto | never | path to a checkpoint file
    fail_at_step: Optional[int] = None  # fault injection for tests: kill rank fail_rank here
    fail_rank: int = 1


@dataclass
class TrainConfig:
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0
    deterministic: bool = False
    device: str = "auto"  # auto | cpu | cuda
    output_root: str = "outputs"
    run_dir: Optional[str] = None  # default: <output_root>/<date>/<time>_<recipe>_<mode>


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def compose(overrides=()):
    """The config train.py would see for these command-line overrides (for scripts and tests)."""
    from pathlib import Path

    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides))
