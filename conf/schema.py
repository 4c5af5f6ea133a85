"""Typed schema of the training config.

Each setting's default and its comment live here, once: conf/train.yaml holds only the
defaults list (which group files compose) and Hydra's own settings, and a group file only
what its choice changes. Hydra merges them into these dataclasses, so a
mistyped key, a value of the wrong type or a choice outside an Enum fails at compose
time with Hydra's own message (``Key 'epochz' is not in struct``, ``Value 'abc' could
not be converted to Integer``, ``Invalid value 'tpu', expected one of [auto, cpu,
cuda]``), even under ``--cfg job``. Every choice the framework owns is an Enum here; the
choices of graphing come from graphing/options.py. Checks that need more than a type
(ranges, combinations, the machine) live in trainer/plan.py. Choices a recipe owns
(its data sources, its model options) are the recipe's to check when it is built.

Components come in by ``_target_``: the recipe's builder, the optimizer class and the
learning-rate schedule (a device-side schedule from trainer/step/schedules.py, or your own). The
optimizer and the schedule are partial, as in lightning-hydra-template (``_partial_: true``,
which may be left out): the trainer completes the call, adding the parameters and a device
learning rate to the optimizer's keys, and base_lr and total_steps to the schedule's. Any other
``_partial_`` is refused, naming the key. Every setting is read or refused (trainer/plan.py).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, FrozenSet, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf, open_dict

from graphing.options import CaptureErrorMode, CompileMode, GraphMode, OnCaptureFailure

__all__ = ["CaptureErrorMode", "CompileMode", "GraphMode", "OnCaptureFailure"]  # re-exported: one import for config users


class Device(Enum):
    auto = "auto"  # the local rank's GPU when there is one, else the CPU
    cpu = "cpu"
    cuda = "cuda"


class LoaderKind(Enum):
    auto = "auto"  # device when the data fits in (30% of free) device memory, else host
    device = "device"  # the whole dataset lives on the accelerator
    host = "host"  # DataLoader workers, pinned memory, non_blocking copies


class WorkerStart(Enum):  # how DataLoader workers start (trainer/data/workers.py)
    forkserver = "forkserver"  # forked from a server of one thread that has torch imported (spawn where none)
    spawn = "spawn"  # a fresh interpreter each: the dataset is pickled, torch imported per worker
    fork = "fork"  # forked from the rank: for datasets that cannot be pickled; may deadlock on a lock that
    # another of the rank's threads held at that instant


class Precision(Enum):
    fp32 = "fp32"
    bf16 = "bf16"  # autocast to bfloat16 (weights, grads and optimizer state stay fp32)
    fp16 = "fp16"  # autocast to float16 with a dynamic loss scale (GradScaler), for GPUs without fast bf16 (T4, V100)
    auto = "auto"  # bf16 on CUDA, fp32 elsewhere


class MemoryFormat(Enum):
    auto = "auto"  # channels_last on CUDA for models with 2-D convolutions, else contiguous
    channels_last = "channels_last"  # NHWC: what cuDNN's fast convolution kernels want
    contiguous = "contiguous"


class GradReduce(Enum):
    fp32 = "fp32"  # gradients all-reduced as they are
    # DDP's bf16_compress_hook: half the bytes on the wire; each rank's gradient is rounded to bf16
    # before the sum, so the loss differs from fp32's by that rounding
    bf16 = "bf16"


class Float8(Enum):
    """torchao's float8 recipes (docs/float8.md): the matmuls of the Linear layers inside a recipe's blocks."""
    none = "none"  # every matmul in train.precision
    tensorwise = "tensorwise"  # one scale per tensor; under fsdp2 its weights can be all-gathered in float8
    rowwise = "rowwise"  # one scale per row: closer to bf16's numbers, a little slower


class ExportDtype(Enum):
    """The dtype of the weights checkpoint.export writes (scripts/export_hf.py --dtype takes the same names)."""
    fp32 = "fp32"  # as they trained: the exported model's logits are the run's, bit for bit
    bf16 = "bf16"  # half the bytes, as most published checkpoints are; each weight rounded once
    fp16 = "fp16"

    @property
    def torch_dtype(self):
        import torch  # here, not at the top: this module imports no torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


class Parallel(Enum):
    ddp = "ddp"  # DistributedDataParallel: a whole replica of weights, gradients and optimizer state per rank
    # FSDP2 (fully_shard): weights, gradients and optimizer state sharded over all ranks, each block
    # all-gathered for its forward and backward, gradients reduce-scattered (trainer/parallel/sharding.py)
    fsdp2 = "fsdp2"


class ReduceDtype(Enum):
    fp32 = "fp32"  # gradients reduce-scattered in fp32
    bf16 = "bf16"  # in bf16 (with train.precision=bf16): half the bytes, each rank's gradient rounded first


class FSDPRoot(Enum):
    """How FSDP2 holds what the recipe's blocks leave (embeddings, final norm, head) between forward and backward,
    with train.fsdp.reshard_after_forward=true (false keeps every unit gathered)."""
    # one root unit, resharded after forward like the blocks: gathered again first thing in backward
    resharded = "resharded"
    # one root unit kept gathered from forward to backward (FSDP2's own default for a root): one all-gather a step
    # instead of two, for the root's weights held through the step
    gathered = "gathered"
    # torchtitan's layout: each embedding outside the blocks a unit of its own (resharded after forward), the
    # root (final norm, head) kept gathered
    split = "split"


class FSDPInit(Enum):
    # built on the host by the recipe, as under DDP, then sharded: the same weights as DDP from the same seed
    host = "host"
    # built on the meta device, sharded, then each rank draws only its own shards on its device
    # (Recipe.init_weights): a model larger than one device or the host fits, but the numbers drawn
    # differ from a host-built model's
    meta = "meta"


class LoggerBackend(Enum):
    wandb = "wandb"
    none = "none"


class WandbMode(Enum):
    offline = "offline"  # write locally; `wandb sync` uploads later
    online = "online"
    disabled = "disabled"


@dataclass
class DataConfig:
    source: str = "auto"  # what to train on: each recipe's config lists what it accepts
    root: str = "data"  # where a recipe's files are (real sets, image folders, token files)
    loader: LoaderKind = LoaderKind.device
    batch_size: int = 64  # per rank
    eval_batch_size: int = 1000  # per rank; the last batch is padded and masked
    # false: each epoch's last partial training batch is a smaller step (its own graph), padded
    # and masked across ranks; true: it is dropped
    drop_last: bool = False
    # language models: sequence lengths to train on, shortest first, each for an equal share of
    # the steps (trainer/step/seq_len.py); empty: the whole window always
    seq_len_buckets: List[int] = field(default_factory=list)
    # DataLoader worker processes (host loader; device loader: for reading the data once); null: this rank's share
    # of the cores less one (trainer/data/workers.py loader_workers)
    num_workers: Optional[int] = 0
    worker_start: WorkerStart = WorkerStart.forkserver
    worker_timeout_s: float = 300.0  # a loader whose workers send no batch for this long stops the run, naming them
    # samples (language models: windows): synthetic data draws this many; real data, folders and files
    # give a seeded random subset; None: the recipe's synthetic size, all of real data
    train_size: Optional[int] = None
    test_size: Optional[int] = None
    path: Optional[str] = None  # text recipes: a file to tokenize; refused by recipes that read none
    # language models on token files with document boundaries (packed rows): "document" attends within each
    # document, "causal" across the whole row; auto: document where the data has boundaries, else causal
    attention: str = "auto"
    # its kernel (recipes/document_attention.py): auto (flex on CUDA, dense elsewhere), flex, varlen, dense
    attention_kernel: str = "auto"
    # a document longer than recipe.model.context: cut into pieces (true), or refused (false)
    split_long_documents: bool = True
    # image folders (recipes/image_folder.py): training crops' share of the image's area, [low, high], as
    # torchvision's RandomResizedCrop; null: [0.08, 1.0] where the images' sizes differ from the recipe's,
    # no crops where they all match it; set: crops whatever the sizes
    crop_scale: Optional[List[float]] = None
    # image folders that are cropped: evaluation resizes the shorter side to the recipe's size / this
    # and takes the center crop (torchvision's references: 224 of 256)
    eval_resize_ratio: float = 0.875


@dataclass
class RecipeConfig:
    _target_: str = "recipes.mnist.build"  # build(cfg, runtime) -> trainer.recipe.Recipe
    name: str = "mnist"  # names the run directory, results and checkpoints
    data: DataConfig = field(default_factory=DataConfig)
    # Any torch.optim class (or yours) by _target_; its other keys are its arguments.
    optim: Dict[str, Any] = field(default_factory=lambda: {"_target_": "torch.optim.SGD", "_partial_": True,
                                                           "lr": 0.01})
    # A device-side schedule (trainer/step/schedules.py: Constant, Cosine, or yours); its other keys are its arguments.
    schedule: Dict[str, Any] = field(default_factory=lambda: {"_target_": "trainer.step.schedules.Constant",
                                                              "_partial_": True})
    model: Dict[str, Any] = field(default_factory=dict)  # checked by the recipe's model
    # 0: off. The recipe's loss applies it and its Recipe says so (trainer/recipe.py): set for a recipe
    # that does not apply it, the run is refused
    label_smoothing: float = 0.0
    # top-1 accuracy in the train and eval metrics; a language model pays for it with an argmax
    # over the vocabulary in every step (gpt2_small: 0.7 ms of a 34 ms step); false: loss only
    accuracy: bool = True


@dataclass
class GraphConfig:
    mode: GraphMode = GraphMode.auto
    warmup_iters: int = 11  # DDP needs 11 eager iterations before capture
    capture_error_mode: CaptureErrorMode = CaptureErrorMode["global"]
    compile_model: bool = False  # full mode: torch.compile(mode=compile_mode) inside the graph
    compile_mode: CompileMode = CompileMode.default  # or max-autotune-no-cudagraphs (minutes of autotuning)
    on_failure: OnCaptureFailure = OnCaptureFailure.fail
    compare: bool = False  # time eager steps, then graph steps, in this process
    compare_steps: int = 100  # steps timed in each mode; with compare=true only (refused without)
    max_graphs: int = 8  # graphs per step role, one per input shape (a last partial batch, sequence-length buckets)
    shape_warmup_iters: int = 1  # eager steps at each further shape before its capture


@dataclass
class LossScaleConfig:
    """The dynamic loss scale of train.precision=fp16 (torch.amp.GradScaler's settings)."""
    init: float = 65536.0  # the scale at the start
    growth_interval: int = 2000  # doubled after this many steps without an inf/NaN gradient; halved on one


@dataclass
class DDPConfig:
    """DistributedDataParallel's gradient all-reduce; read only with more than one process."""
    # MiB per all-reduce bucket. null: torch's default, 25 MiB after a 1 MiB first bucket (so the
    # all-reduce starts early in backward); a number caps every bucket, the first one too
    bucket_cap_mb: Optional[float] = None
    grad_reduce: GradReduce = GradReduce.fp32
    static_graph: bool = False  # DDP's static_graph: the same parameters get gradients in every step
    # DDP's broadcast_buffers: rank 0's buffers (BatchNorm's running statistics) copied to every
    # rank before each forward. false: not; evaluation takes rank 0's first either way. FSDP2 never
    # broadcasts them while training (as false), whatever this says
    broadcast_buffers: bool = True


@dataclass
class FSDPConfig:
    """FSDP2's settings (train.parallel=fsdp2; refused with ddp)."""
    # true: each block's full weights are freed after its forward and all-gathered again for backward
    # (less memory, one more all-gather per block); false: kept from forward to backward
    reshard_after_forward: bool = True
    # what the blocks leave (embeddings, final norm, head): resharded | gathered | split (FSDPRoot)
    root: FSDPRoot = FSDPRoot.resharded
    reduce_dtype: ReduceDtype = ReduceDtype.fp32
    init: FSDPInit = FSDPInit.host
    # true (train.float8=tensorwise): each weight is cast to float8 before its all-gather (half of bf16's bytes),
    # its scale computed for all weights in one all-reduce at the start of each step
    float8_all_gather: bool = False


@dataclass
class TrainLoopConfig:
    epochs: int = 10
    max_steps: Optional[int] = None  # stop early after this many optimizer steps
    log_every: int = 50
    eval: bool = True  # evaluate on the whole test set after each epoch
    eval_only: bool = False  # evaluate the restored (or init_from) weights once, train nothing
    grad_clip: float = 0.0  # max global grad norm; 0 disables
    grad_accum: int = 1  # micro-batches per optimizer step, all inside one graph
    precision: Precision = Precision.fp32
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # fp16 only (refused with another)
    memory_format: MemoryFormat = MemoryFormat.auto  # of the model and its 4-D inputs (set inside the step)
    # Recompute each block's forward in backward instead of keeping its activations: less memory, about
    # one more forward of compute. The recipe applies it (Recipe.activation_checkpointing) or is refused.
    activation_checkpointing: bool = False
    progress: bool = True  # progress bar on rank 0
    # Under torchrun, a rank that sees no step finish for this long (at least 20 median steps; the first steps of a
    # graph, an evaluation and a checkpoint's save get 15 times as long, 15 min at least) says which rank and step,
    # aborts the process group and exits with 8, so a restart resumes from the last checkpoint; a rank that is
    # stopped or stuck holding the GIL is ended by its guard process (trainer/run/watchdog.py). null: off
    stall_timeout_s: Optional[float] = 60.0
    # The matmuls of the Linear layers inside the recipe's blocks in float8 (torchao; compute capability 8.9+):
    # faster where the GPU is busy, with compile (graph=full_compiled). docs/float8.md
    float8: Float8 = Float8.none
    float8_emulate: bool = False  # torchao's emulation of float8 (plain matmuls), for CPU tests; eager only
    parallel: Parallel = Parallel.ddp  # how ranks share the model: replicas (ddp) or shards (fsdp2)
    ddp: DDPConfig = field(default_factory=DDPConfig)  # train.parallel=ddp only (refused with fsdp2)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)  # train.parallel=fsdp2 only (refused with ddp)


@dataclass
class WandbConfig:
    project: str = "graphed-ddp"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    job_type: Optional[str] = None  # default: the graph mode
    mode: Optional[WandbMode] = None  # default: WANDB_MODE, else offline
    all_ranks: bool = False  # one run per rank (grouped) instead of rank 0 only
    init_timeout_s: float = 60.0


@dataclass
class LoggerConfig:
    backend: LoggerBackend = LoggerBackend.wandb
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CheckpointConfig:
    # false: no checkpoint is written at all (none at the end, none on SIGTERM): for a model whose checkpoint
    # the disk cannot hold. Resuming and init_from still read one
    save: bool = True
    # A checkpoint is written at the end and whenever any of these is due (0 turns one off).
    every_steps: int = 0
    every_epochs: int = 1
    every_minutes: float = 10.0  # of training; decided by rank 0, agreed at a log interval
    keep: int = 2
    resume: str = "auto"  # auto | never | path to a checkpoint file
    init_from: Optional[str] = None  # a checkpoint whose weights start a fresh run (fine-tuning)
    best_metric: Optional[str] = None  # e.g. eval/accuracy (higher is better) or eval/loss (lower): best.pt
    # A new directory the recipe writes its trained model to at the end of the run, in its library's format
    # (hf_causal_lm: a save_pretrained directory; sharded runs write from their shards). Refused if it exists,
    # unless it is this run's own (the same command again: trainer/checkpoint/export.py)
    export: Optional[str] = None
    # of the exported weights (their config.json says it too); with checkpoint.export only (refused without)
    export_dtype: ExportDtype = ExportDtype.fp32


@dataclass
class TrainConfig:
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0
    deterministic: bool = False  # torch's deterministic algorithms, where it has them (a warning where not)
    device: Device = Device.auto
    output_root: str = "outputs"
    # One directory per job, shared by all ranks (decided by rank 0). Default:
    # <output_root>/<date>/<time>_<recipe>_<mode>
    run_dir: Optional[str] = None
    # One owner per run_dir, held by a lock (trainer/run/run_lock.py). true: where the filesystem refuses
    # locks, take over a run_dir whose owner record names another host
    take_over_run_dir: bool = False


def changed_settings(node, defaults) -> Dict[str, Any]:
    """The keys of a settings group whose values differ from its schema's defaults."""
    values = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    base = OmegaConf.to_container(OmegaConf.structured(defaults), resolve=True, enum_to_str=True)
    return {k: v for k, v in values.items() if v != base.get(k)}


def settings_the_user_changed(cfg, path: str, defaults) -> Dict[str, Any]:
    """``changed_settings`` of the group at ``path`` (``train.fsdp``), kept to the keys that this job's own
    overrides set (the command line; a script's overrides): what the plan refuses where a setting means nothing.
    A recipe's or an experiment's values are its presets (gpt_1b's ``train.fsdp.init=meta`` is for fsdp2, and
    ``train.parallel=ddp`` leaves it unread), never refused. For a config composed without a record of its
    overrides (built in code), every value that differs from the schema's default counts."""
    changed = changed_settings(OmegaConf.select(cfg, path), defaults)
    overridden = keys_overridden(cfg)
    if overridden is None:
        return changed
    return {k: v for k, v in changed.items()
            if any(f"{path}.{k}" == key or f"{path}.{k}".startswith(f"{key}.") for key in overridden)}


def as_typed(value) -> str:
    """A setting's value as an override types it (``true``, ``null``, ``bf16``), for messages that name one."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# The keys each config that compose() returned had overridden, by id(cfg), with a weak reference that tells a
# config still alive from a new one that reuses its id.
_overridden_by_config: Dict[int, Any] = {}


def keys_overridden(cfg) -> Optional[FrozenSet[str]]:
    """The config keys (``train.fsdp.init``; not group choices such as ``recipe=gpt_1b``) that ``cfg``'s overrides
    set: compose()'s for a config it returned, else this job's command line under ``@hydra.main`` (train.py);
    None where neither is known."""
    from hydra.core.hydra_config import HydraConfig

    recorded = _overridden_by_config.get(id(cfg))
    if recorded is not None and recorded[0]() is cfg:
        return recorded[1]
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not under @hydra.main
        return None
    return _value_keys(hydra_cfg.overrides.task, hydra_cfg.runtime.choices)


def _value_keys(overrides, choices) -> FrozenSet[str]:
    """The keys of ``overrides`` that set values, not group choices (``choices``: Hydra's chosen groups)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return frozenset(o.key_or_group for o in parsed if o.key_or_group not in choices and not o.is_hydra_override())


def register_configs() -> None:
    """Stores the typed schema in Hydra's ConfigStore, once per process: storing converts the whole dataclass
    tree into a config (a fifth of a compose's time), and every load hands out a copy of the stored one."""
    if "train_schema.yaml" not in ConfigStore.instance().repo:
        ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def compose(overrides=(), config_dir=None, config_name="train"):
    """The config ``python train.py [--config-dir DIR] [--config-name NAME] overrides`` would see.

    For scripts and tests. ``config_dir`` joins the search path as train.py's ``--config-dir``
    does: after conf/ (a file of the same name in conf/ wins), so ``DIR/recipe/mine.yaml`` is
    ``recipe=mine``; a relative path is from the current directory. ``config_name`` is the
    primary config (``--config-name``). Raises Hydra's own errors (hydra.errors.HydraException),
    with the words train.py prints for the same command line. The keys the overrides set are kept for the
    plan (``keys_overridden``), as @hydra.main keeps them for train.py.
    """
    import os

    from hydra import compose as hydra_compose, version
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import SearchPathException

    register_configs()
    # What @hydra.main builds for train.py (hydra/_internal/utils.py, run_hydra); the public
    # initialize_config_dir() takes only one directory.
    search_path = create_config_search_path(f"file://{os.path.dirname(os.path.abspath(__file__))}")
    if config_dir is not None:
        absolute = os.path.abspath(config_dir)
        if not os.path.isdir(absolute):
            raise SearchPathException(f"Additional config directory '{absolute}' not found")
        search_path.prepend(provider="command-line", path=f"file://{absolute}", anchor=SearchPathQuery(provider="schema"))
    GlobalHydra.instance().clear()
    version.setbase("1.3")
    Hydra.create_main_hydra2(task_name="train", config_search_path=search_path)
    try:
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    # What the overrides set, kept for the plan (keys_overridden), as @hydra.main keeps it in HydraConfig
    keys = _value_keys(cfg.hydra.overrides.task, cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    for stale in [k for k, (ref, _) in _overridden_by_config.items() if ref() is None]:
        del _overridden_by_config[stale]
    _overridden_by_config[id(cfg)] = (weakref.ref(cfg), keys)
    return cfg
