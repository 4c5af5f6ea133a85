"""Any Hugging Face transformers causal language model, trained on the gpt recipe's data.

The model, from exactly one of (``recipe.model``):
- ``config``: a transformers config as a mapping, its ``model_type`` and settings
  (``{model_type: llama, hidden_size: 64, num_hidden_layers: 2, ...}``), with random weights:
  ``AutoConfig.for_model(**config)``, then ``AutoModelForCausalLM.from_config``;
- ``path``: a local directory that ``save_pretrained`` wrote (config.json and the weights),
  loaded with ``local_files_only=True``: nothing is ever downloaded.
``recipe.model.context`` is the tokens per sample. Weights are held in fp32 (train.precision
autocasts the step, as for every recipe).

Data: the gpt recipe's own (``recipes.gpt.language_data``: a text file as bytes, token files,
or the synthetic language), windows of ``context + 1`` token ids below the model's ``vocab_size``.
Every window is whole, so nothing is padded and the model gets no attention mask, only its
causal one. (An epoch's last evaluation batch is padded with whole samples, which the
trainer's own mask leaves out of the metrics; they never meet a real token.)

The step calls ``model(input_ids)``, the token ids positionally (graph.mode=partial replays
positional tensors), with ``use_cache=False`` set in the model's config rather than passed,
and the criterion reads the output's ``logits`` (``Recipe.forward``, trainer/recipe.py).
Its blocks (``Recipe.blocks``, what train.parallel=fsdp2 shards one by one) are the modules of the
classes its own ``_no_split_modules`` names. Under ``train.fsdp.init=meta`` a model from ``config`` is
built on the meta device and, once sharded and allocated, drawn by transformers' own initialization
(``initialize_weights``, rotary frequencies included: ``init_weights`` below), so no rank holds it
whole; every parameter and buffer is checked to have been written, and one that was not stops the
run naming it. A model from ``path`` under ``train.fsdp.init=meta`` is built the same way from its
config.json, then each rank reads only the parts of its shards from the directory's safetensors files
(``load_pretrained_shards``): no rank holds it whole, in the files' dtype or the model's.

transformers is optional: ``pip install -r requirements-hf.txt``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from conf.schema import ExportDtype, FSDPRoot, Parallel
from recipes.gpt import (attention_mode, check_attention_kernel, is_packed, language_data, next_token_criterion,
                         preprocess)
from recipes.chunked_head import chunked_head_criterion, pass_hidden_states_through
from recipes.hf_documents import document_logits, packed_logits, use_document_attention
from trainer.run.errors import ConfigError, first_line
from trainer.recipe import Batch, Recipe, blocks_named
from trainer.run.process import quiet_pytree_registrations
from trainer.run.runtime import Runtime
from graphing.sharded import local_tensor

REQUIREMENT = "transformers>=5.17,<6"  # as requirements-hf.txt says
INSTALL = "pip install -r requirements-hf.txt"
MODEL_KEYS = ("config", "path", "context", "head_chunk_tokens", "head_loss_tokens_per_row")


@dataclass(frozen=True)
class ModelSettings:
    """``recipe.model``: exactly one of ``config`` (a mapping) and ``path``, the context, ``head_chunk_tokens``
    (the LM head and its loss this many tokens at a time, recipes/chunked_head.py; None: the whole step's logits)
    and ``head_loss_tokens_per_row`` (training's head at the loss tokens only, each packed row carrying at most
    this many; None: at every token)."""
    config: Optional[Dict[str, Any]]
    path: Optional[str]
    context: int
    head_chunk_tokens: Optional[int] = None
    head_loss_tokens_per_row: Optional[int] = None

    @property
    def chunked_head(self) -> bool:
        """Whether the loss applies the head itself (recipes/chunked_head.py) rather than read the model's logits."""
        return self.head_chunk_tokens is not None or self.head_loss_tokens_per_row is not None


def transformers_module(recipe: str = "hf_causal_lm"):
    """transformers, imported; a ConfigError that says what to install where it is missing or out of range."""
    try:
        with quiet_pytree_registrations():  # transformers imports torchao where it is installed
            import transformers
    except ImportError as e:
        raise ConfigError(f"recipe {recipe!r} needs Hugging Face transformers ({REQUIREMENT}), which this Python "
                          f"cannot import ({e}): {INSTALL}") from None
    from packaging.version import Version

    found = Version(transformers.__version__)
    if not Version("5.17") <= found < Version("6"):
        raise ConfigError(f"recipe {recipe!r} needs Hugging Face {REQUIREMENT}, but transformers {found} is "
                          f"installed: {INSTALL}")
    return transformers


def model_settings(settings) -> ModelSettings:
    """``recipe.model``, checked: known keys, exactly one of config and path, a positive context."""
    values = (OmegaConf.to_container(settings, resolve=True) if isinstance(settings, DictConfig)
              else dict(settings or {}))
    for key in values:
        if key not in MODEL_KEYS:
            raise ConfigError(f"recipe.model.{key} is not a setting of recipe.model: remove it, or use one of "
                              f"{', '.join('recipe.model.' + k for k in MODEL_KEYS)} (the model's own settings "
                              f"go in recipe.model.config.{key})")
    config, path, context = values.get("config"), values.get("path"), values.get("context")
    if config is not None and path is not None:
        raise ConfigError("recipe.model.config and recipe.model.path are both set, but a model comes from one of "
                          "them: set recipe.model.config=null to load the model in recipe.model.path, or "
                          "recipe.model.path=null to build recipe.model.config with random weights")
    if config is None and path is None:
        raise ConfigError("neither recipe.model.config nor recipe.model.path is set: set recipe.model.config to a "
                          "transformers config ({model_type: llama, hidden_size: ..., ...}) for random weights, "
                          "or recipe.model.path to a directory that save_pretrained wrote")
    if config is not None and not (isinstance(config, dict) and isinstance(config.get("model_type"), str)):
        raise ConfigError(f"recipe.model.config={config!r} must be a mapping with a model_type: set "
                          "recipe.model.config.model_type=llama (or qwen2, gpt2, any transformers causal LM)")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ConfigError(f"recipe.model.context={context!r} must be a positive integer: the tokens per sample, "
                          "e.g. recipe.model.context=512")
    chunk = values.get("head_chunk_tokens")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ConfigError(f"recipe.model.head_chunk_tokens={chunk!r} must be a positive integer (tokens a chunk, "
                          "e.g. 4096), or null for the whole step's logits at once")
    per_row = values.get("head_loss_tokens_per_row")
    if per_row is not None and (isinstance(per_row, bool) or not isinstance(per_row, int)
                                or not 1 <= per_row <= context):
        raise ConfigError(f"recipe.model.head_loss_tokens_per_row={per_row!r} must be an integer from 1 to "
                          f"recipe.model.context={context} (the most loss tokens a packed row carries, e.g. 3/4 of "
                          "the context for conversations), or null for the head at every token")
    return ModelSettings(config, path, context, chunk, per_row)


def model_config(settings: ModelSettings, transformers):
    """The transformers config the model is built from: recipe.model.config's, or the one in recipe.model.path."""
    if settings.path is not None:
        directory = Path(settings.path).expanduser()
        if not (directory / "config.json").is_file():
            raise ConfigError(f"recipe.model.path={settings.path!r} is not a directory holding a model's config.json "
                              "(what save_pretrained writes): models are read from disk only, never downloaded. "
                              "Download one first (`hf download <repo> --local-dir <dir>`) and set "
                              "recipe.model.path=<dir>, or build one: recipe.model.path=null recipe.model.config=...")
        try:
            return transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"recipe.model.path={settings.path!r}: transformers cannot read its config.json "
                              f"({first_line(e)})") from None
    given = dict(settings.config)
    try:
        config = transformers.AutoConfig.for_model(**given)
    except Exception as e:  # an unknown model_type, a value its class validates and refuses
        raise ConfigError(f"recipe.model.config is not a transformers config ({first_line(e)}): fix "
                          "recipe.model.config") from None
    unread = unread_keys(config, given)
    if unread:
        key = unread[0]
        close = difflib.get_close_matches(key, known_keys(type(config)), n=1)
        hint = f"did you mean recipe.model.config.{close[0]}?" if close else "remove it"
        raise ConfigError(f"recipe.model.config.{key} is not a setting of {type(config).__name__} (model_type "
                          f"{config.model_type}): transformers would keep it unread; {hint} (a config of another "
                          "model_type replaces the default whole: recipe.model.config=null "
                          "'+recipe.model.config={model_type: ..., ...}')")
    return config


def known_keys(cls) -> List[str]:
    """The settings a transformers config class declares: its fields, its arguments and their aliases."""
    names = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", {}))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return sorted(names - {"self", "kwargs"})


def unread_keys(config, given: Dict[str, Any]) -> List[str]:
    """Keys of ``given`` that ``config`` keeps verbatim as extra attributes (a typo, say). Legacy keys the
    class converts (``rope_theta`` into ``rope_parameters``) are read, and not kept."""
    known = set(known_keys(type(config)))
    return [k for k in given if k != "model_type" and k not in known and k in vars(config)]


def check_config(config, settings: ModelSettings) -> None:
    """What would train a wrong model without a word: a bidirectional encoder, a context past the positions."""
    source = "recipe.model.config" if settings.path is None else f"recipe.model.path={settings.path!r}"
    if getattr(config, "is_decoder", None) is False and "is_decoder" in config.to_dict():
        fix = "Set recipe.model.config.is_decoder=true, or choose" if settings.path is None else "Choose"
        raise ConfigError(f"{source} is a {type(config).__name__} with is_decoder=false: its tokens attend both "
                          f"ways, so it would see the tokens it predicts. {fix} a decoder (llama, qwen2, gpt2, ...)")
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and settings.context > limit:
        raise ConfigError(f"recipe.model.context={settings.context} is longer than the model's "
                          f"max_position_embeddings={limit} ({source}): set recipe.model.context={limit} or less"
                          + (", or raise it in recipe.model.config" if settings.path is None else ""))


def build_model(config, settings: ModelSettings, transformers) -> torch.nn.Module:
    auto = transformers.AutoModelForCausalLM
    try:
        with quiet_pytree_registrations():  # the model's module imports torchao where it is installed
            if settings.path is None:
                model = auto.from_config(config, dtype=torch.float32)
            else:
                model = auto.from_pretrained(Path(settings.path).expanduser(), config=config, local_files_only=True,
                                             dtype=torch.float32)
    except ValueError as e:  # a config class that has no causal LM
        raise ConfigError(f"model_type {config.model_type} has no causal language model in transformers "
                          f"(AutoModelForCausalLM: {first_line(e)}): choose a decoder such as llama, qwen2 or gpt2"
                          ) from None
    except OSError as e:  # weights missing or unreadable
        raise ConfigError(f"recipe.model.path={settings.path!r}: transformers cannot load its weights "
                          f"({first_line(e)})") from None
    model.config.use_cache = False  # training keeps no key/value cache; set here, the call passes tensors only
    use_causal_sdpa(model, transformers)
    return model.train()  # from_pretrained returns it in eval mode


# transformers' SDPA attention registered under a name of its own with no mask function beside it: for this name
# transformers builds no attention mask at all (its mask builders return None for an implementation that has
# none registered), and SDPA is called with is_causal=True, the flash kernel's path.
CAUSAL_SDPA = "sdpa_causal_unpadded"


def use_causal_sdpa(model: torch.nn.Module, transformers) -> None:
    """Switches ``model`` from transformers' "sdpa" attention to :data:`CAUSAL_SDPA` where the mask transformers
    would build is the plain causal one.

    Why: transformers decides per call whether SDPA may skip the mask and use ``is_causal``, and it never skips
    while a CUDA stream captures (its ``is_tracing`` counts capture as tracing). So a captured step would
    materialize a T x T mask that no eager step builds: another attention kernel (no flash; at 8192 tokens,
    1.5x the step time of a 1.5B Llama on H200s), memory for the mask, and under graph=full_compiled a mask
    argument that the compiled blocks never saw in warm-up, so they recompile inside the capture and it fails.
    This recipe's windows are never padded and carry no mask (``logits`` below), so the mask is causal and
    nothing else; this makes that true for eager and graphed steps alike, and lets SDPA pick flash in both.
    Left alone: any other attention implementation, and every model whose mask is more than causal (a sliding
    window, chunked attention, a bidirectional or non-causal config), for which transformers' own mask stays."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not plain_causal_mask(model.config):
        return
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    transformers.AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)  # idempotent
    model.set_attn_implementation(CAUSAL_SDPA)


def plain_causal_mask(config) -> bool:
    """Whether the attention mask transformers builds for ``config``'s layers, given unpadded windows whose
    positions count from 0, is the causal one: no sliding window or attention chunks on any layer, every layer
    of type full attention, and a causal decoder."""
    for c in (c for c in (config, getattr(config, "text_config", None)) if c is not None):
        if getattr(c, "is_causal", True) is False or getattr(c, "is_decoder", True) is False:
            return False
        if getattr(c, "sliding_window", None) is not None or getattr(c, "attention_chunk_size", None) is not None:
            return False
        layer_types = getattr(c, "layer_types", None)
        if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
            return False
    return True


def init_weights(model: torch.nn.Module) -> None:
    """``Recipe.init_weights`` (train.fsdp.init=meta): the allocated, sharded model drawn by transformers'
    own ``initialize_weights``, as ``from_config`` would have drawn it whole.

    Built on the meta device, transformers skipped its initialization (nothing to draw there), and
    ``to_empty`` left every parameter and buffer holding whatever its memory held. Each is first filled
    with a mark (NaN; an integer's lowest value), then initialized; one still marked was not written by
    its model's ``_init_weights`` and would train from garbage: refused, by name."""
    import torch.distributed as dist

    named = [*model.named_parameters(), *model.named_buffers()]
    unmarkable = [name for name, t in named if t.dtype == torch.bool]
    if unmarkable:
        raise ConfigError(f"train.fsdp.init=meta: {type(model).__name__}'s {unmarkable[0]} is a boolean tensor whose "
                          "initialization cannot be checked after a meta-device build: set train.fsdp.init=host")
    with torch.no_grad():
        for _, tensor in named:
            local_tensor(tensor).fill_(_mark(tensor.dtype))
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)  # transformers skips a module marked initialized
    model.initialize_weights()
    device = local_tensor(named[0][1]).device if named else torch.device("cpu")  # NCCL reduces device tensors only
    marks = [_still_marked(local_tensor(t)).to(device) for _, t in named]  # on the device: read once, below
    left = torch.stack(marks).float() if marks else torch.zeros(0, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(left)  # a rank's shard may be empty: every rank decides alike
    if bool(left.any()):
        name = named[int(left.nonzero()[0].item())][0]
        raise ConfigError(f"train.fsdp.init=meta: {type(model).__name__}'s {name} is not written by transformers' "
                          "initialization after a meta-device build (its model's _init_weights leaves it): set "
                          "train.fsdp.init=host")


def pretrained_files(directory: Path, path: str) -> List[Path]:
    """The safetensors files of a save_pretrained directory (one file, or the shards its index names), or a
    ConfigError naming the path."""
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise ConfigError(f"recipe.model.path={path!r} holds no *.safetensors weights, which train.fsdp.init=meta reads "
                          "shard by shard: save the model with save_pretrained (safetensors is its default), or set "
                          "train.fsdp.init=host (transformers then reads any format it can)")
    return files


def load_pretrained_shards(directory: Path, model: torch.nn.Module) -> None:
    """``Recipe.init_weights`` for ``recipe.model.path`` under train.fsdp.init=meta: the sharded, allocated model
    drawn and checked as ``init_weights`` does (buffers the files do not hold, such as rotary frequencies, are
    computed there), then every weight read from the directory's safetensors files, each rank reading only the
    parts of its own shards (torch.distributed.checkpoint's HuggingFaceStorageReader), in the files' dtype
    converted to the model's (bf16 files into fp32 weights). A weight tied to another (GPT-2's lm_head to its
    token embedding) is read once; a weight the files lack, or one of another shape, is refused by name."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load

    init_weights(model)
    reader = HuggingFaceStorageReader(str(directory))
    try:
        in_files = reader.read_metadata().state_dict_metadata
    except Exception as e:  # an index naming a missing file, a truncated header
        raise ConfigError(f"recipe.model.path={str(directory)!r}: its safetensors files cannot be read "
                          f"({first_line(e)})") from None
    tied = set(tied_names(model))
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    state = {k: v for k, v in model.state_dict().items() if k not in tied}
    lacking = sorted(k for k in state if k in params and k not in in_files)
    if lacking:
        raise ConfigError(f"recipe.model.path={str(directory)!r} lacks {len(lacking)} of the model's weights "
                          f"({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}): its config.json and "
                          "weights do not match; set train.fsdp.init=host to load it with transformers' own rules")
    for k, v in state.items():
        saved = in_files.get(k)
        if saved is not None and tuple(saved.size) != tuple(v.shape):
            raise ConfigError(f"recipe.model.path={str(directory)!r}: {k} is {tuple(saved.size)} in its files but "
                              f"{tuple(v.shape)} in the model its config.json describes")
    try:
        load({k: v for k, v in state.items() if k in in_files}, storage_reader=reader)
    except Exception as e:  # a truncated file, bytes that do not match the header
        raise ConfigError(f"recipe.model.path={str(directory)!r}: its weights cannot be read ({first_line(e)})") from None


# Files of a save_pretrained directory that are not weights and go with the model (tokenizers, generation).
COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
              "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def tied_names(model: torch.nn.Module) -> List[str]:
    """The names of weights that are another, earlier-named weight (GPT-2's lm_head.weight): written once."""
    seen, tied = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.append(name)
        seen.add(id(p))
    return tied


# The largest exported file (save_pretrained's default). Its size bounds what a rank holds while it writes:
# torch.distributed.checkpoint serializes each file in memory, whole, beside the tensors it holds on the host
# (an 8B model in one file cost a rank 48.6 GiB of host memory; RESULTS.md).
EXPORT_FILE_BYTES = 5 * 10**9
JOIN_THREADS = 4  # files joined at once from the ranks' parts (each thread holds a tensor or two on the host)
INDEX_FILE = "model.safetensors.index.json"


def plan_files(layout: Mapping[str, Tuple[Sequence[int], torch.dtype]], max_bytes: Optional[int] = None):
    """The files of a save_pretrained directory and the tensors in each, from each tensor's (shape, dtype) as it
    will be written (a DTensor's whole shape; nothing is read): huggingface_hub's
    ``split_torch_state_dict_into_shards``, save_pretrained's own planner (in ``layout``'s order, files of at most
    ``max_bytes``, default ``EXPORT_FILE_BYTES``; a larger tensor alone in its own; one file is
    model.safetensors). Its ``StateDictSplit`` also holds the index. huggingface_hub comes with transformers."""
    from huggingface_hub import split_torch_state_dict_into_shards

    shaped = {name: torch.empty(tuple(shape), dtype=dtype, device="meta") for name, (shape, dtype) in layout.items()}
    return split_torch_state_dict_into_shards(shaped, max_shard_size=EXPORT_FILE_BYTES if max_bytes is None
                                              else max_bytes)


def write_weights(directory: Path, plan, tensor: Callable[[str], torch.Tensor]) -> None:
    """The one writer of a save_pretrained directory's weights (checkpoint.export, scripts/export_hf.py,
    scripts/bench_pretrained.py): ``plan``'s safetensors files (``plan_files``) and, for several, their index,
    ``tensor(name)`` giving each tensor (whole, or this rank's DTensor shards), written by
    torch.distributed.checkpoint's HuggingFaceStorageWriter. Under a process group every rank writes its parts of
    every file and rank 0 joins them into whole files, a thread a file: no rank gathers the model (under DDP each
    replicated tensor is written once). One process writes a file at a time, asking for its tensors only then, so
    it holds about one file's tensors and their bytes on the host whatever the model's size. Rank 0 leaves the
    directory whole."""
    import shutil

    import torch.distributed as dist
    from torch.distributed.checkpoint import HuggingFaceStorageWriter, save

    distributed = dist.is_available() and dist.is_initialized()
    files = list(plan.filename_to_tensors)
    number = {name: i for i, names in enumerate(plan.filename_to_tensors.values(), 1) for name in names}
    if distributed:
        # Each rank writes its part of each file into sharded/, then rank 0 joins the parts into whole files.
        save({name: tensor(name) for name in plan.tensor_to_filename}, storage_writer=HuggingFaceStorageWriter(
            path=str(directory), fqn_to_index_mapping=number, save_distributed=True, enable_consolidation=True,
            thread_count_consolidation=min(len(files), JOIN_THREADS)))
        if dist.get_rank() != 0:
            return
        shutil.rmtree(directory / "sharded", ignore_errors=True)  # each rank's part, joined into the files
    else:
        for names in plan.filename_to_tensors.values():
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                save({name: tensor(name) for name in names}, no_dist=True,
                     storage_writer=HuggingFaceStorageWriter(path=str(directory), fqn_to_index_mapping=number))
    # torch numbers every file (model-00001-of-00001.safetensors for one); save_pretrained names one file
    # model.safetensors, and its index is the plan's (torch's, written a file at a time, holds the last file's).
    for i, file in enumerate(files, 1):
        numbered = directory / f"model-{i:05d}-of-{len(files):05d}.safetensors"
        if numbered.name != file:
            os.replace(numbered, directory / file)
    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    else:
        (directory / INDEX_FILE).unlink(missing_ok=True)


def export_pretrained(source: Optional[Path], model: torch.nn.Module, directory: Path,
                      dtype: torch.dtype = torch.float32) -> None:
    """``Recipe.export`` (checkpoint.export): the trained model as a save_pretrained directory that transformers,
    vLLM and the Hub read: its config.json, its weights as safetensors (a tied weight once; ``write_weights``:
    every rank its own shards, no rank gathering the model), and the tokenizer and generation files of ``source``
    (recipe.model.path). ``dtype`` (checkpoint.export_dtype): the floating-point weights' in the files, each rank
    casting its own shards, and config.json's ``dtype``, which transformers loads them in."""
    import copy

    import torch.distributed as dist

    tied = set(tied_names(model))
    state = {k: v for k, v in model.state_dict().items() if k not in tied}

    def written(v: torch.Tensor) -> torch.Tensor:
        return v.to(dtype) if v.is_floating_point() else v

    plan = plan_files({k: (v.shape, dtype if v.is_floating_point() else v.dtype) for k, v in state.items()})
    write_weights(directory, plan, lambda name: written(state[name]))
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    config = copy.deepcopy(model.config)
    config.use_cache = True  # off while training only (build_model)
    config.dtype = dtype
    config.save_pretrained(directory)
    copy_companions(source, directory)


def copy_companions(source: Optional[Path], directory: Path) -> None:
    """The tokenizer and generation files of the source directory (recipe.model.path), beside exported weights."""
    import shutil

    if source is None:
        return
    for name in COMPANIONS:
        if (source / name).is_file():
            shutil.copy2(source / name, directory / name)


def _mark(dtype: torch.dtype):
    return float("nan") if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).min


def _still_marked(tensor: torch.Tensor) -> torch.Tensor:
    """Whether any element of ``tensor`` still holds ``_mark``'s value: a 0-dim bool on its device (False if empty)."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return torch.isnan(tensor).any()
    return (tensor == torch.iinfo(tensor.dtype).min).any()


def training_flops_per_token(model: torch.nn.Module, context: int) -> float:
    """6 FLOPs per matmul parameter per token (forward + backward), plus attention's 12·L·d·T.

    Embedding lookups are left out; the output head is a matmul, counted once even when tied to the
    token embedding. 0 (unknown) for a config without num_hidden_layers and hidden_size."""
    config = model.config
    layers, width = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if not (isinstance(layers, int) and isinstance(width, int)):
        return 0.0
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings()
    if head is not None:
        lookups.discard(id(head.weight))
    n_params = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    return 6.0 * n_params + 12.0 * layers * width * context


def logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``Recipe.forward``: the token ids, positionally and without an attention mask (no window is padded);
    the output object's logits [B, T, vocab] are what the criterion reads."""
    return model(batch["x"]).logits


def packed_documents_forward(model: torch.nn.Module, attention: str, transformers, kernel: str = "auto") -> Callable:
    """``Recipe.forward`` for packed rows of documents (recipes/hf_documents.py): each document's own positions,
    and attention within each document or causal across the row. Causal needs the causal SDPA switch
    (``use_causal_sdpa``): with any other implementation transformers would guess document masks from the
    positions in eager steps only, and a graphed step would train differently."""
    if attention == "document":
        use_document_attention(model, transformers, plain_causal_mask(model.config))
        return functools.partial(document_logits, kernel=kernel)
    if model.config._attn_implementation != CAUSAL_SDPA:
        raise ConfigError(f"recipe.data.attention=causal over packed documents needs a plain causal SDPA model, and "
                          f"this {model.config.model_type} model uses {model.config._attn_implementation!r} attention "
                          "(or a mask more than causal): set recipe.data.attention=document")
    return packed_logits


def chunked_head(model: torch.nn.Module, settings: ModelSettings, cfg):
    """The criterion of ``recipe.model.head_chunk_tokens`` and ``head_loss_tokens_per_row``: the model's ``lm_head``
    passes its hidden states through and the loss applies the head a chunk at a time, at the loss tokens only with
    the second (recipes/chunked_head.py); refused where the head's weight is
    not a plain local tensor when the loss reads it (under FSDP2, a root resharded after forward: kept gathered,
    the root's weights stay whole from its forward to its backward, where FSDP2 reduce-scatters the head's
    gradient with the rest of the root's), or the model does more after its head."""
    given = {f"recipe.model.{name}": value for name, value in (
        ("head_chunk_tokens", settings.head_chunk_tokens),
        ("head_loss_tokens_per_row", settings.head_loss_tokens_per_row)) if value is not None}
    key = " and ".join(f"{name}={value}" for name, value in given.items())
    fsdp = cfg.train.fsdp
    refuse = [why for why, applies in (
        # The loss reads the head's weight after the model's forward: FSDP2 must still hold it gathered then.
        ("train.parallel=fsdp2 with its root resharded after forward (the head's weight is sharded again before "
         "the loss reads it; set train.fsdp.root=gathered)",
         Parallel(cfg.train.parallel) is Parallel.fsdp2 and fsdp.reshard_after_forward
         and FSDPRoot(fsdp.root) is FSDPRoot.resharded),
        (f"{model.config.model_type}'s softcapped logits", getattr(model.config, "final_logit_softcapping", None)),
    ) if applies]
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        refuse.append(f"the head of {type(model).__name__} is not one bias-free linear layer")
    if refuse:
        raise ConfigError(f"{key} cannot be used with {'; '.join(refuse)}: set "
                          f"{' and '.join(name + '=null' for name in given)}")
    pass_hidden_states_through(head)
    return chunked_head_criterion(head, settings.head_chunk_tokens, cfg.recipe.label_smoothing,
                                  settings.head_loss_tokens_per_row)


def build(cfg, rt: Runtime) -> Recipe:
    transformers = transformers_module(cfg.recipe.name)
    settings = model_settings(cfg.recipe.model)
    config = model_config(settings, transformers)
    check_config(config, settings)
    vocab_key = ("recipe.model.config.vocab_size" if settings.path is None
                 else f"vocab_size (in recipe.model.path={settings.path!r})")
    data = language_data(cfg.recipe.data, cfg.seed, settings.context, config.vocab_size, vocab_key,
                         settings.head_loss_tokens_per_row, "recipe.model.head_loss_tokens_per_row")
    meta = rt is not None and rt.init_device.type == "meta"
    draw = init_weights
    source = None if settings.path is None else Path(settings.path).expanduser()
    if meta and source is not None:  # built from its config, sharded, then each rank reads its own parts
        pretrained_files(source, settings.path)  # refused now, before any rank builds, if there are none
        settings = dataclasses.replace(settings, path=None)
        draw = functools.partial(load_pretrained_shards, source)
    with torch.device("meta") if meta else contextlib.nullcontext():  # meta: nothing allocated until sharded
        model = build_model(config, settings, transformers)
    forward = logits
    if is_packed(data):
        attention = attention_mode(cfg.recipe.data, packed=True)
        if attention == "document":
            check_attention_kernel(cfg, rt)
        forward = packed_documents_forward(model, attention, transformers, cfg.recipe.data.attention_kernel)
    criterion = next_token_criterion(cfg.recipe.label_smoothing)
    if settings.chunked_head:
        criterion = chunked_head(model, settings, cfg)
    return Recipe(name=cfg.recipe.name, model=model, data=data, preprocess=preprocess,
                  criterion=criterion, correct=criterion.top1,
                  units_per_sample=settings.context, unit="tokens",
                  flops_per_unit=training_flops_per_token(model, settings.context), forward=forward,
                  loss_average="labels" if forward is not logits else "micro_batch",
                  label_smoothing=cfg.recipe.label_smoothing,
                  blocks=blocks_named(model, model._no_split_modules),  # its own list: LlamaDecoderLayer, ...
                  init_weights=draw, export=functools.partial(
                      export_pretrained, source, dtype=ExportDtype(cfg.checkpoint.export_dtype).torch_dtype))
