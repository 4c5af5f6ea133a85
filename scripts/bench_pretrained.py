"""Pretrained weights in and out at any size, measured (issue 51): a save_pretrained directory read straight into
FSDP2 shards, trained a few steps, and written back out as a save_pretrained directory from the shards.

    python scripts/bench_pretrained.py --size 8b --nproc 2                  # writes a random bf16 8B directory first
    python scripts/bench_pretrained.py --size 1b --nproc 2 --compare-host   # and the same weights loaded whole
    python scripts/bench_pretrained.py --source DIR --nproc 2 -- recipe.model.context=4096
    python scripts/bench_pretrained.py --size tiny --nproc 2 --reload -- graph=eager   # a CPU smoke test (gloo)

The source: ``--source DIR`` (a save_pretrained directory of a causal LM), or else one this script writes under
``--work`` (kept there, reused by the next call): the Llama 3 shape ``--size`` (scripts/lib/llama3.py; ``tiny``
for tests) with random weights (every matrix N(0, 0.02), the norms 1, seeded), in bf16 as checkpoints on the
Hub are, in safetensors files of at most 5 GB with their index, one file in memory at a time. No download.

The runs, under torchrun (``--nproc`` ranks; ``train.py recipe=hf_causal_lm recipe.model.path=SOURCE``):
``meta``: ``train.parallel=fsdp2 train.fsdp.init=meta`` (each rank reads only its own parts of the files),
``--steps`` steps on the synthetic language, ``checkpoint.save=false`` (an 8B checkpoint with AdamW's state is
about 96 GB) and ``checkpoint.export`` (the trained model written from the shards at the end); with
``--compare-host`` first a ``host`` run: the same with ``train.fsdp.init=host`` (every rank loads the whole model
on the host, then shards it: the path that existed before), whose first loss the ``meta`` run must repeat
(the first forward reads the loaded weights alone; later steps part as any two runs do where kernels are not
deterministic, the largest difference reported).
Per run: the peak host memory of a rank over the whole run, the time from the launch to the first step (the
process's start-up, the load included) and of the first step, tokens/s per GPU, the losses of the first steps,
the export's time and its peak host and GPU memory (train.py's report). ``--reload``: the exported directory is
read back by transformers (``AutoModelForCausalLM.from_pretrained``, on the host, in bf16) and run on a batch:
its time, its names and shapes against the source's, every logit finite. The logits-equal round trip itself is
a test (tests/test_hf_causal_lm.py on CPU, tests/test_hf_pretrained_gpu.py on 2 GPUs).

Prints a Markdown table and writes it with every run's numbers to ``--output`` (default
scripts/results/pretrained_<size>_<N>gpu.json and .md). Needs transformers (``pip install -r requirements-hf.txt``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.lib.launch import check_overrides, hydra_value, run_or_exit, train_launcher  # noqa: E402
from scripts.lib.llama3 import INIT_STD, SHAPES, LlamaShape, hf_config  # noqa: E402
from scripts.lib.refuse import refuse  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402

# A shape for tests and a CPU smoke run: the 8B layout at a toy size.
TINY = LlamaShape("tiny", dim=64, layers=2, heads=4, kv_heads=2, ffn_dim_multiplier=None, multiple_of=32,
                  flavour=None, vocab=256)
SIZES = {**SHAPES, "tiny": TINY}
EXPORT_LINE = re.compile(r"exported the trained model to (?P<dir>.+) in (?P<s>[\d.]+) s; peak host memory of a rank "
                         r"(?P<host>[\d.]+) GiB \(its whole run\)(?:, peak GPU memory allocated during the export "
                         r"(?P<gpu>[\d.]+) GiB)?")


def write_random_pretrained(directory: Path, config: Dict[str, Any], seed: int = 0) -> Dict[str, Any]:
    """A save_pretrained directory of ``config`` with random bf16 weights, written under a temporary name and
    renamed when whole; returns what it took (seconds, bytes, files). The model is laid out on the meta device
    for its names and shapes; the files are written as an export writes them (recipes/hf_causal_lm.py
    ``write_weights``), each file's tensors drawn only when it is written."""
    import torch
    import transformers

    from recipes.hf_causal_lm import plan_files, write_weights

    began = time.perf_counter()
    hf = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    plan = plan_files({name: (shape, torch.bfloat16) for name, shape in shapes.items()})  # files of 5 GB
    temp = directory.parent / f".{directory.name}.tmp"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    hf.save_pretrained(temp)
    generator = torch.Generator().manual_seed(seed)

    def draw(name: str) -> torch.Tensor:  # asked in the plan's order: the files' order, each file's own
        if len(shapes[name]) == 1 and name.endswith("norm.weight"):
            return torch.ones(shapes[name], dtype=torch.bfloat16)
        return torch.empty(shapes[name]).normal_(0.0, INIT_STD, generator=generator).to(torch.bfloat16)

    write_weights(temp, plan, draw)
    os.replace(temp, directory)
    return {"seconds": time.perf_counter() - began, "bytes": plan.metadata["total_size"],
            "files": len(plan.filename_to_tensors), "tensors": len(shapes)}


def tensor_shapes(directory: Path) -> Dict[str, tuple]:
    """Every tensor's name and shape in a save_pretrained directory's safetensors files (their headers alone)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


# The model's source and how it is loaded: what the runs compare, set here for every run (and composed first, with
# the user's overrides, by script_config).
DEFAULTS = ["recipe=hf_causal_lm", "recipe.model.config=null"]
FIXED = ("recipe", "recipe.model.config", "recipe.model.path", "train.parallel", "train.fsdp.init",
         "train.max_steps", "checkpoint.save", "checkpoint.export", "run_dir", "train.log_every")


def run_overrides(args: argparse.Namespace, source: Path, init: str, run_dir: Path, export: Optional[Path]) -> List[str]:
    """The train.py overrides of one run; the user's come last (none of FIXED)."""
    return [*DEFAULTS, f"recipe.model.path={hydra_value(str(source))}",
            f"recipe.model.context={args.seq_len}", f"recipe.data.batch_size={args.local_batch}",
            "recipe.data.source=synthetic", f"recipe.data.train_size={max(64, 4 * args.steps * args.nproc)}",
            "recipe.data.test_size=2", "recipe.data.drop_last=true", "recipe.accuracy=false",
            "train.parallel=fsdp2", f"train.fsdp.init={init}", f"train.max_steps={args.steps}", "train.epochs=1",
            "train.eval=false", "train.log_every=1", "train.progress=false", "logger=none", "checkpoint.save=false",
            *([f"checkpoint.export={hydra_value(str(export))}"] if export else []),
            f"run_dir={hydra_value(str(run_dir))}", *args.overrides]


def one_run(args: argparse.Namespace, name: str, source: Path, init: str, export: Optional[Path]) -> Dict[str, Any]:
    run_dir = args.work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [*train_launcher(args.nproc, torchrun=True), *args.train_options,
               *run_overrides(args, source, init, run_dir, export)]
    log = args.work / "runs" / f"{name}.log"
    wall = run_or_exit("bench_pretrained", name, command, args.timeout, {"PYTHONUNBUFFERED": "1"}, log)
    results = json.loads((run_dir / "results.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    run = {"name": name, "init": init, "wall_s": wall, "losses": [r["train/loss"] for r in rows if "train/loss" in r],
           "startup_s": results.get("time/startup_s"), "first_step_s": results.get("time/first_step_s"),
           "tokens_per_s_per_gpu": results.get("perf/tokens_per_s_per_gpu"),
           "peak_reserved_mib": results.get("perf/peak_reserved_mib"),
           "peak_host_mib_rank0": results.get("perf/peak_host_mib"), "results": results}
    found = EXPORT_LINE.search(log.read_text())
    if export is not None:
        if not found:
            sys.exit(f"bench_pretrained: {name} ended without the export's report line; its output: {log}")
        run["export_s"] = float(found["s"])
        run["peak_host_gib_any_rank"] = float(found["host"])
        run["export_peak_gpu_gib"] = float(found["gpu"]) if found["gpu"] else None
    return run


def reload_check(source: Path, export: Path) -> Dict[str, Any]:
    """transformers reads the exported directory back and runs a batch: its time, and whether its tensors are the
    source's names and shapes with every logit finite."""
    import torch
    import transformers

    began = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16, local_files_only=True)
    loaded = time.perf_counter() - began
    vocab = model.config.vocab_size
    with torch.no_grad():
        logits = model(torch.arange(16).remainder(vocab).unsqueeze(0)).logits
    return {"reload_s": loaded, "same_layout": tensor_shapes(source) == tensor_shapes(export),
            "finite_logits": bool(torch.isfinite(logits).all()), "parameters": sum(p.numel() for p in model.parameters())}


def report(record: Dict[str, Any]) -> str:
    lines = ["| run | launch to first step s | first step s | peak host GiB (a rank, whole run) | tokens/s per GPU "
             "| peak reserved GiB | loss at steps 1..3 | export s | export peak GPU GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in record["runs"]:
        host = run.get("peak_host_gib_any_rank") or (run["peak_host_mib_rank0"] or 0) / 1024
        reserved = (run["peak_reserved_mib"] or 0) / 1024
        lines.append(
            f"| {run['name']} (train.fsdp.init={run['init']}) | {run['startup_s']:.1f} | {run['first_step_s']:.2f} | "
            f"{host:.1f} | {run['tokens_per_s_per_gpu'] or 0:,.0f} | {reserved:.1f} | "
            f"{', '.join(f'{v:.4f}' for v in run['losses'][:3])} | "
            + (f"{run['export_s']:.1f} | {run['export_peak_gpu_gib'] or 0:.2f} |" if "export_s" in run else "| |"))
    notes = [f"source: {record['source']} ({record['parameters']:,} parameters"
             + (f"; written in {record['written']['seconds']:.0f} s, {record['written']['files']} files)"
                if record.get("written") else ")")]
    if "same_first_loss" in record:
        notes.append(f"meta's first loss is host's: {record['same_first_loss']} (relative difference at step 1 "
                     f"{record['first_loss_difference']:.1e}; the largest over all steps, run-to-run noise, "
                     f"{record['loss_difference']:.1e})")
    if "reload" in record:
        r = record["reload"]
        notes.append(f"reloaded by transformers in {r['reload_s']:.1f} s: the source's names and shapes "
                     f"{r['same_layout']}, every logit finite {r['finite_logits']}")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="8b", help="the Llama 3 shape of the written source")
    parser.add_argument("--source", type=Path, default=None, help="a save_pretrained directory to read instead")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun), one GPU each")
    parser.add_argument("--steps", type=int, default=20,
                        help="optimizer steps per run (graph modes: 11 eager, the capture, then replays)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--local-batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--compare-host", action="store_true", help="first the same weights loaded whole on the host")
    parser.add_argument("--reload", action="store_true", help="transformers reads the export back (on the host)")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "bench_pretrained",
                        help="the written source, every run and the export")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument("--output", type=Path, default=None)
    args, _ = script_config(parser, defaults=DEFAULTS)
    check_overrides(args.overrides, FIXED, "bench_pretrained")
    try:
        import transformers  # noqa: F401
    except ImportError:
        refuse("bench_pretrained: needs transformers: pip install -r requirements-hf.txt")
    args.work = args.work.resolve()
    (args.work / "runs").mkdir(parents=True, exist_ok=True)
    record: Dict[str, Any] = {"nproc": args.nproc, "steps": args.steps, "seq_len": args.seq_len,
                              "local_batch": args.local_batch, "overrides": args.overrides}
    if args.source is not None:
        source = args.source.resolve()
        if not (source / "config.json").is_file():
            refuse(f"bench_pretrained: --source {args.source} holds no config.json: give a save_pretrained directory")
    else:
        source = args.work / f"source_{args.size}"
        if not (source / "config.json").is_file():
            print(f"bench_pretrained: writing a random bf16 {args.size} directory to {source}", flush=True)
            record["written"] = write_random_pretrained(source, hf_config(SIZES[args.size]))
    record["source"] = str(source)
    record["parameters"] = sum(math.prod(shape) for shape in tensor_shapes(source).values())
    export = args.work / "export"
    shutil.rmtree(export, ignore_errors=True)
    runs = []
    if args.compare_host:
        runs.append(one_run(args, "host", source, "host", None))
    runs.append(one_run(args, "meta", source, "meta", export))
    record["runs"] = runs
    if args.compare_host:
        host, meta = runs[0]["losses"], runs[1]["losses"]
        differences = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(host, meta)]
        record["loss_difference"] = max(differences)
        record["first_loss_difference"] = differences[0]
        record["same_first_loss"] = len(host) == len(meta) and record["first_loss_difference"] <= 1e-6
    if args.reload:
        record["reload"] = reload_check(source, export)
    table = report(record)
    print(table)
    name = args.size if args.source is None else source.name
    output = args.output or REPO / "scripts" / "results" / f"pretrained_{name}_{args.nproc}gpu.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2, default=str) + "\n")
    output.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
