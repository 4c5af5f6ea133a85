"""What a caller may ask of graphing, as types, and the checks that need more than a type.

Free of torch on purpose: conf/schema.py types its `graph.*` settings with these Enums,
so that composing a config (`python train.py --cfg job`) rejects a bad choice without
loading torch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable, Optional

DDP_MIN_WARMUP = 11  # DDP samples stats with host syncs and rebuilds buckets in its first 10 iterations
# ... and again around every 100th forward it runs from Python (graph replays do not count):
# a capture is never made at such a forward (graphing/full.py, ``ddp_samples_next``).
DDP_STATS_EVERY = 100


class GraphMode(Enum):
    auto = "auto"  # full on CUDA, eager elsewhere
    eager = "eager"
    full = "full"  # the whole training step as one CUDA graph per rank
    partial = "partial"  # torch.cuda.make_graphed_callables on the model
    compile = "compile"  # torch.compile(mode="reduce-overhead"): inductor's own CUDA graphs


# `global` is a Python keyword, hence the functional form; members are looked up by name.
CaptureErrorMode = Enum("CaptureErrorMode", [("global", "global"), ("thread_local", "thread_local"),
                                             ("relaxed", "relaxed")])
CaptureErrorMode.__doc__ = """`torch.cuda.graph`'s capture_error_mode: which unsafe CUDA calls abort a capture.

global: from any thread (the safe default); thread_local: only from the capturing thread,
so a pinned-memory loader thread may run; relaxed: never."""


class CompileMode(Enum):
    """torch.compile's mode for ``compile_model``: kernels captured inside the whole-step graph.
    Not "reduce-overhead" or "max-autotune", which bring CUDA graphs of their own."""
    default = "default"
    max_autotune_no_cudagraphs = "max-autotune-no-cudagraphs"  # autotuned matmuls and Triton configs: slow to compile


class OnCaptureFailure(Enum):
    fail = "fail"  # every rank stops with the reason
    eager = "eager"  # every rank continues eagerly


CAPTURING_MODES = (GraphMode.full, GraphMode.partial, GraphMode.compile)
STEP_MODES = (GraphMode.eager, GraphMode.full)  # what GraphedStep runs: a whole step, graphed or not


class SettingMessage:
    """An error whose message names graphing's settings by their own names (``mode``,
    ``warmup_iters``, ...). A caller that calls them something else (a config path) words
    the message itself with ``render``; ``str()`` uses graphing's names."""

    def __init__(self, template: str):
        self.template = template  # str.format placeholders: {setting_name}
        super().__init__(self.render())

    def render(self, name: Optional[Callable[[str], str]] = None) -> str:
        """The message, each setting named by ``name(setting)`` (graphing's own names by default)."""
        return render(self.template, name)


# What graphing's own messages call the tools a caller may name differently.
OWN_NAMES = {"doctor": "graphing.diagnose(step_fn, model, optimizer, inputs)"}


def own_name(setting: str) -> str:
    return OWN_NAMES.get(setting, setting)


def render(template: str, name: Optional[Callable[[str], str]] = None) -> str:
    """A message template with each {setting} named by ``name(setting)``."""
    return template.format_map(_Names(name or own_name))


class _Names(dict):
    def __init__(self, name: Callable[[str], str]):
        super().__init__()
        self.name = name

    def __missing__(self, setting: str) -> str:
        return self.name(setting)


def literal(text: str) -> str:
    """``text`` safe inside a message template (an underlying error's braces stay braces)."""
    return text.replace("{", "{{").replace("}", "}}")


class GraphConfigError(SettingMessage, ValueError):
    """A graph setting that cannot work; the message names the setting to change."""


def _value(choice) -> str:
    return choice.value if isinstance(choice, Enum) else str(choice)


@dataclass(frozen=True)
class GraphOptions:
    """How a step executes. Strings or the Enums above are accepted for the choices;
    ``mode`` is held as a ``GraphMode``, the other choices as their string values.

    ``warmup_iters``: eager steps before capture (at least 11 under DDP).
    ``eager_steps_before_capture``: further eager steps after warm-up (timed as "eager",
    for a same-process comparison).
    ``max_graphs``: how many input shapes get a graph of their own (per step role: train,
    eval); a shape beyond them stops the run (``on_failure="fail"``) or runs eagerly.
    ``shape_warmup_iters``: eager calls at each shape after the first before its capture
    (cuBLAS, cuDNN and torch.compile choose their kernels per shape).
    """

    mode: GraphMode = GraphMode.full
    warmup_iters: int = DDP_MIN_WARMUP
    capture_error_mode: str = "global"
    on_failure: str = "fail"
    compile_model: bool = False  # full mode: torch.compile(mode=compile_mode) inside the graph
    compile_mode: str = "default"
    eager_steps_before_capture: int = 0
    max_graphs: int = 8
    shape_warmup_iters: int = 1

    def __post_init__(self):
        for name, kind in (("mode", GraphMode), ("capture_error_mode", CaptureErrorMode),
                           ("on_failure", OnCaptureFailure), ("compile_mode", CompileMode)):
            value = _value(getattr(self, name))
            choices = [member.value for member in kind]
            if value not in choices:
                raise GraphConfigError(f"{{{name}}}={literal(repr(value))} is not one of {', '.join(choices)}")
            object.__setattr__(self, name, GraphMode(value) if kind is GraphMode else value)

    @property
    def captures(self) -> bool:
        """Whether this mode captures CUDA graphs (and so needs a GPU)."""
        return self.mode in CAPTURING_MODES

    def resolved(self, device_type: str, world_size: int, cuda_available: bool = True) -> "GraphOptions":
        """These options with ``auto`` resolved for the device, after checking they can work there."""
        mode = self.mode
        if mode is GraphMode.auto:
            mode = GraphMode.full if device_type == "cuda" else GraphMode.eager
        m = mode.value
        if mode in CAPTURING_MODES and device_type != "cuda":
            why = "this machine has no usable CUDA GPU" if not cuda_available else f"the device is {device_type}"
            raise GraphConfigError(f"{{mode}}={m} needs a CUDA GPU but {why}: set {{mode}}=eager "
                                   "({mode}=auto picks eager without a GPU)")
        if self.compile_mode != CompileMode.default.value and not self.compile_model:
            raise GraphConfigError(f"{{compile_mode}}={literal(self.compile_mode)} applies to {{compile_model}}=true "
                                   "(the model compiled inside the whole-step graph): set {compile_model}=true, or "
                                   "drop {compile_mode}")
        if self.compile_model and mode is not GraphMode.full:
            raise GraphConfigError(f"{{compile_model}}=true applies to {{mode}}=full, not {m}: "
                                   "set {mode}=full or {compile_model}=false")
        if mode in (GraphMode.full, GraphMode.partial):
            if world_size > 1 and self.warmup_iters < DDP_MIN_WARMUP:
                raise GraphConfigError(
                    f"{{warmup_iters}}={self.warmup_iters} is too few under DDP: DistributedDataParallel runs "
                    "host-synchronizing bookkeeping in its first 10 iterations and rebuilds its buckets, which "
                    f"cannot happen inside a CUDA graph; set {{warmup_iters}}={DDP_MIN_WARMUP} or more")
            if self.warmup_iters < 1:
                raise GraphConfigError(f"{{warmup_iters}}={self.warmup_iters} must be at least 1 (cuBLAS, cuDNN "
                                       "and the optimizer state must exist before capture): set {warmup_iters}=11")
        if self.max_graphs < 1:
            raise GraphConfigError(f"{{max_graphs}}={self.max_graphs} must be at least 1 (the graphs a step may "
                                   "have, one per input shape): set {max_graphs}=8")
        if self.shape_warmup_iters < 1:
            raise GraphConfigError(f"{{shape_warmup_iters}}={self.shape_warmup_iters} must be at least 1: a new "
                                   "input shape needs one eager call (kernel choice) before its capture")
        if self.eager_steps_before_capture < 0:
            raise GraphConfigError(f"eager_steps_before_capture={self.eager_steps_before_capture} must be >= 0")
        return replace(self, mode=mode)
