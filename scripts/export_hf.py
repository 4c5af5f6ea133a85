"""Writes a run's trained model as a save_pretrained directory that transformers, vLLM and the Hub read.

    python scripts/export_hf.py RUN_DIR --out DIR                      # the run's newest checkpoint
    python scripts/export_hf.py RUN_DIR --out DIR --checkpoint RUN_DIR/checkpoints/step_00000100.dcp
    python scripts/export_hf.py RUN_DIR --out DIR --dtype bf16 --shard-gb 5

For a run of recipe=hf_causal_lm or of a gpt recipe (gpt_tiny ... gpt_1b: GPT-2's layout, written as transformers'
GPT2LMHeadModel), from any of its checkpoints, of any world size (one file, or every rank's shards): DIR gets
config.json (the run's model config: recipe.model.config, recipe.model.path's config.json, or the GPT-2 config of
the gpt recipe's shape), the weights as safetensors (one model.safetensors, or files of at most --shard-gb with
model.safetensors.index.json), and the tokenizer and generation files the source directory had. A weight tied
to another (GPT-2's lm_head) is written once, as save_pretrained writes it.

How it runs: one process, no GPU, no process group. It reads one tensor at a time (a sharded checkpoint through
torch.distributed.checkpoint, each tensor whole from every rank's shards; a one-file checkpoint memory-mapped)
and writes the files as checkpoint.export does (recipes/hf_causal_lm.py ``write_weights``, save_pretrained's plan
by huggingface_hub): a file at a time, its tensors read only then, so its peak host memory is about two output
files (--shard-gb: the tensors, and the file serialized before it is written), whatever the model's size.
The directory is written under a temporary name beside DIR and renamed when whole: DIR never exists
half-written. Refused with exit 2, naming the path: a DIR that exists, a run without a checkpoint or of a recipe
with no transformers class mapped here (mnist, cifar10), a checkpoint that lacks a weight of the model.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conf.schema import ExportDtype  # noqa: E402
from scripts.lib.refuse import refuse  # noqa: E402


@dataclass(frozen=True)
class Weight:
    """One tensor of the exported files: ``name`` there, from the checkpoint's ``source`` (transposed where the
    transformers class keeps it the other way round), or zeros of ``shape`` where the class has a tensor the
    trained model has not (GPT-2's biases, for a model trained without)."""
    name: str
    source: Optional[str]
    transpose: bool = False
    shape: Tuple[int, ...] = ()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a run directory of recipe=hf_causal_lm or a gpt recipe (its config.yaml)")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write (must not exist)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the run's newest checkpoint")
    parser.add_argument("--dtype", choices=[d.value for d in ExportDtype], default=None,
                        help="the files' dtype, and config.json's (default: the checkpoint's, fp32 for this trainer's "
                             "weights; checkpoint.export_dtype's names)")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors file, in GB")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    out = args.out.expanduser().resolve()
    if out.exists():
        refuse(f"--out {out} exists: give a new directory (an export never writes over one)")
    from omegaconf import OmegaConf

    config_file = args.run_dir / "config.yaml"
    if not config_file.is_file():
        refuse(f"{args.run_dir} is not a run directory: it has no config.yaml")
    cfg = OmegaConf.load(config_file)  # read as the trainer wrote it (OmegaConf.to_yaml)
    target = cfg.get("recipe", {}).get("_target_")
    if target not in LAYOUTS:
        refuse(f"{args.run_dir} is a run of recipe._target_={target}, which has no transformers class mapped here: "
               f"export_hf writes {' and '.join(LAYOUTS)} runs")
    checkpoint = args.checkpoint or newest_checkpoint(args.run_dir)
    from trainer.run.errors import ConfigError

    try:
        hf_config, weights, tied, source = LAYOUTS[target](cfg["recipe"]["model"])
    except ConfigError as e:  # the run's model settings, read as its recipe reads them
        refuse(f"{config_file}: {e}")
    read, shapes = tensor_source(checkpoint, [w.source for w in weights if w.source is not None])
    dtype = ExportDtype(args.dtype).torch_dtype if args.dtype else None
    temp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    try:
        files = write_files(temp, weights, read, shapes, dtype, int(args.shard_gb * 1e9))
        # What transformers loads the files in: the dtype written, not the source directory's (a bf16 source's
        # config.json said bfloat16 over fp32 files, and transformers loaded the trained weights rounded).
        hf_config.dtype = dtype or most_common_float(dt for _, dt in shapes.values())
        hf_config.save_pretrained(temp)
        from recipes.hf_causal_lm import copy_companions

        copy_companions(source, temp)
        for path in temp.iterdir():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        os.replace(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    from trainer.metrics.perf import peak_host_mib  # imports torch: not at --help

    print(f"export_hf: {checkpoint} -> {out}: {len(weights)} weights in {len(files)} safetensors file(s)"
          f"{f' ({len(tied)} tied, written once: ' + ', '.join(sorted(tied)) + ')' if tied else ''}; "
          f"{time.perf_counter() - began:.1f} s, peak host memory {peak_host_mib() / 1024:.2f} GiB")
    return 0


def newest_checkpoint(run_dir: Path) -> Path:
    from trainer.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    if not found:
        refuse(f"{run_dir} holds no checkpoint to export (checkpoint.save=false, or the run wrote none yet)")
    return found[-1]


def hf_layout(model_cfg: Dict) -> Tuple[object, List[Weight], List[str], Optional[Path]]:
    """recipe=hf_causal_lm: the transformers config the run trained, read as the recipe reads it (recipe.model.config,
    or recipe.model.path's config.json), its weights under their own names (a tied one once), and the source
    directory if any."""
    from recipes.hf_causal_lm import model_config, model_settings, transformers_module

    settings = model_settings(model_cfg)
    hf_config = model_config(settings, transformers_module())
    names, tied = weight_names(hf_config)
    source = None if settings.path is None else Path(settings.path).expanduser()
    return hf_config, [Weight(name, name) for name in names], tied, source


def gpt_layout(model_cfg: Dict) -> Tuple[object, List[Weight], List[str], Optional[Path]]:
    """The gpt recipes (recipes/gpt.py): GPT-2's layout exactly, as transformers' GPT2LMHeadModel (exact GELU; its
    Conv1D weights are the transposes of these Linear weights; the biases this model trains without are zeros)."""
    from recipes.gpt import model_config as gpt_config
    from recipes.hf_causal_lm import transformers_module

    transformers = transformers_module("gpt")

    c = gpt_config(model_cfg)
    hf_config = transformers.GPT2Config(vocab_size=c.vocab, n_positions=c.context, n_embd=c.d_model, n_layer=c.n_layer,
                                        n_head=c.n_head, activation_function="gelu", resid_pdrop=c.dropout,
                                        embd_pdrop=c.dropout, attn_pdrop=c.dropout, layer_norm_epsilon=1e-5,
                                        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    d = c.d_model

    def norm(ours: str, theirs: str) -> List[Weight]:
        bias = Weight(f"{theirs}.bias", f"{ours}.bias") if c.layer_norm_bias else Weight(f"{theirs}.bias", None,
                                                                                          shape=(d,))
        return [Weight(f"{theirs}.weight", f"{ours}.weight"), bias]

    def linear(ours: str, theirs: str, out: int) -> List[Weight]:
        return [Weight(f"{theirs}.weight", f"{ours}.weight", transpose=True), Weight(f"{theirs}.bias", None,
                                                                                      shape=(out,))]

    weights = [Weight("transformer.wte.weight", "tok_emb.weight"), Weight("transformer.wpe.weight", "pos_emb.weight")]
    for i in range(c.n_layer):
        h, b = f"transformer.h.{i}", f"blocks.{i}"
        weights += [*norm(f"{b}.ln1", f"{h}.ln_1"), *linear(f"{b}.attn.qkv", f"{h}.attn.c_attn", 3 * d),
                    *linear(f"{b}.attn.proj", f"{h}.attn.c_proj", d), *norm(f"{b}.ln2", f"{h}.ln_2"),
                    *linear(f"{b}.mlp.0", f"{h}.mlp.c_fc", 4 * d), *linear(f"{b}.mlp.2", f"{h}.mlp.c_proj", d)]
    weights += norm("ln_f", "transformer.ln_f")
    names, tied = weight_names(hf_config)
    missing = sorted(set(names) - {w.name for w in weights})
    if missing:  # a transformers release whose GPT-2 holds more than this layout writes
        refuse(f"transformers' GPT2LMHeadModel expects {', '.join(missing[:3])}, which this layout does not write")
    return hf_config, weights, tied, None


LAYOUTS = {"recipes.hf_causal_lm.build": hf_layout, "recipes.gpt.build": gpt_layout}


def weight_names(hf_config) -> Tuple[List[str], List[str]]:
    """The transformers model's state-dict names in its own order, less those of weights tied to an earlier one."""
    import torch
    import transformers

    from recipes.hf_causal_lm import tied_names
    from trainer.run.process import quiet_pytree_registrations

    with torch.device("meta"), quiet_pytree_registrations():
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    tied = tied_names(model)
    # save_pretrained's names: the state dict (persistent buffers included), less tied duplicates
    return [name for name in model.state_dict() if name not in tied], tied


def tensor_source(checkpoint: Path, names: List[str]) -> Tuple[Callable[[str], "object"], Dict[str, Tuple]]:
    """``read(name)``: one weight of ``checkpoint``, whole, on the host; and each weight's (shape, dtype), known
    without reading it. Refused if the checkpoint lacks any of ``names``."""
    import torch

    if checkpoint.is_dir():  # every rank's shards (trainer/checkpoint/dcp_shards.py): "model.<name>" entries
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
        shapes = {key[len("model."):]: (tuple(meta.size), meta.properties.dtype) for key, meta in saved.items()
                  if key.startswith("model.") and hasattr(meta, "size")}
        check_holds(checkpoint, names, shapes)

        def read(name: str):
            shape, dtype = shapes[name]
            tensor = torch.empty(shape, dtype=dtype)
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({"model": {name: tensor}}, checkpoint_id=str(checkpoint), no_dist=True,
                         planner=DefaultLoadPlanner(allow_partial_load=True))
            return tensor
        return read, shapes
    state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["model"]  # mapped, not read
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
    check_holds(checkpoint, names, shapes)
    return (lambda name: state[name]), shapes


def check_holds(checkpoint: Path, names: List[str], held) -> None:
    lacking = [n for n in names if n not in held]
    if lacking:
        refuse(f"{checkpoint} lacks {len(lacking)} of the model's weights ({', '.join(lacking[:3])}"
               f"{', ...' if len(lacking) > 3 else ''}): it is not a checkpoint of this run's model")


def write_files(folder: Path, weights: List[Weight], read: Callable[[str], "object"], shapes: Dict[str, Tuple],
                dtype, shard_bytes: int) -> List[str]:
    """The weights as safetensors files of at most ``shard_bytes`` (recipes.hf_causal_lm's ``plan_files`` and
    ``write_weights``: save_pretrained's plan, a file at a time, each tensor read only when its file is written);
    returns the files' names."""
    import torch

    from recipes.hf_causal_lm import plan_files, write_weights

    def shape_and_dtype(w: Weight):
        if w.source is None:
            return w.shape, dtype or torch.float32
        shape, saved = shapes[w.source]
        return (shape[::-1] if w.transpose else shape), dtype or saved

    def tensor(w: Weight):
        shape, kind = shape_and_dtype(w)
        if w.source is None:
            return torch.zeros(shape, dtype=kind)
        t = read(w.source)
        return (t.t() if w.transpose else t).to(kind).contiguous()

    named = {w.name: w for w in weights}
    plan = plan_files({w.name: shape_and_dtype(w) for w in weights}, shard_bytes)
    write_weights(folder, plan, lambda name: tensor(named[name]))
    return list(plan.filename_to_tensors)


def most_common_float(dtypes):
    """The floating-point dtype most of a checkpoint's weights have (this trainer keeps them all in fp32)."""
    from collections import Counter

    import torch

    counts = Counter(dt for dt in dtypes if dt.is_floating_point)
    return counts.most_common(1)[0][0] if counts else torch.float32


if __name__ == "__main__":
    sys.exit(main())
