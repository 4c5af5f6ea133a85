"""This repo against TRL's SFTTrainer on conversations, one GPU, side by side (issue 62 item 5).

    python scripts/bench_trl.py                                   # 0.5b and 1.5b, 60 steps of 4 x 4096 tokens
    python scripts/bench_trl.py --sizes 0.5b --attention flex --trl-attention varlen --no-compile --liger on \\
        --head-chunk none 4096                                    # this repo twice, TRL once: one table
    python scripts/bench_trl.py --dry-run --sizes tiny            # the commands both sides would run; no GPU
    python scripts/bench_trl.py --sizes tiny --context 256 --our-batch 2 --trl-batch 2 --steps 8 --warmup-steps 3 \\
        --graph eager --attention dense --no-compile              # both sides on a CPU, in a minute

For each size, under ``--work`` (made once, then reused): conversations from scripts/lib/chat_data.py (a system
turn and 1-4 exchanges of made-up words, rendered lengths lognormal around 300 tokens, capped at the context, enough
for every step of both sides), a word-level ChatML tokenizer trained on them, a Qwen2-shaped model with random weights
(``tiny``, ``0.5b`` = Qwen2-0.5B's shape, ``1.5b`` = Qwen2-1.5B's; the real vocabulary of 151,936), and
``prepare_text.py --input chat`` token files of the same conversations. Then, one after the other on the same GPU:

- TRL: scripts/lib/trl_worker.py, its SFTTrainer with its fastest settings (packing ``bfd`` with ``padding_free``,
  ``assistant_only_loss``, bf16, ``torch_compile`` (``--no-compile``: off; on an H200 its compile of the model
  ran past 4 minutes, with Liger it failed), Liger's kernels with ``--liger on``, fused AdamW), ``--trl-batch``
  packed rows of at most ``--context`` tokens a step;
- this repo: ``train.py recipe=hf_causal_lm`` on the token files, ``graph=full_compiled``, ``--our-batch`` packed
  rows of ``--context`` tokens a step, attention within each document;

both with this repo's document attention (``--attention``; registered in TRL's model through transformers'
AttentionInterface; ``--trl-attention`` gives TRL another kernel: flex, compiled for one shape, recompiles at each
of TRL's padding-free batch lengths and never got past its first steps on an H200, so TRL takes varlen there),
the same optimizer and schedule (AdamW, lr 2e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1, 10 warm-up steps then
constant, gradient clipping at 1.0), ``--steps`` steps of which the first ``--warmup-steps`` are not timed (this
repo's: its eager warm-up and the capture), and the loss read every step.

Real tokens per second: the tokens that are not padding trained in the timed steps over their wall window (the first
timed step's start to the last one's end, trainer/metrics/perf.py WallWindow on both sides): this repo's
perf/wall_real_tokens_per_s, TRL's counted from its batches. The ratio column is this repo's over TRL's. Peak memory:
torch.cuda.max_memory_allocated over the whole run. Writes scripts/results/trl_sft_<size>.json and .md (rows with
the commit, versions and GPU) and the two loss curves in one PNG beside them. A run that fails or runs past
``--timeout`` stays in the table with its status, and the script exits 1. Needs trl (``pip install -r
scripts/requirements-trl.txt``) and, unless told to run both sides on a CPU, a CUDA GPU; ``--dry-run`` needs neither.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as `python scripts/bench_trl.py`: find conf/ and scripts/

from scripts.lib.chat_data import SIZES  # noqa: E402
from scripts.lib.comparison import comparison_rows, exit_status, installed, provenance, provenance_line  # noqa: E402
from scripts.lib.launch import (  # noqa: E402
    CPU_MODES, RESERVED, cuda_device_count, exit_on_sigterm, gpu_name, graph_names, hydra_value, override_key,
    run_or_exit, run_or_mark,
)
from scripts.lib.refuse import refuse  # noqa: E402
from scripts.lib.trl_worker import INSTALL, KERNELS, MATCHED  # noqa: E402
from trainer.metrics.results import markdown_table, write_json  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402

SCRIPT = "bench_trl.py"
VAL_FRACTION = 0.01  # this repo's validation split (unused: train.eval=false); TRL trains on every conversation
DATA_MARGIN = 1.25  # conversations for this many times the tokens the steps take: no side runs out
# What this script sets for this repo's runs: refused as the user's overrides (they would break the match).
SETS = (*RESERVED, "recipe", "logger", "seed", "checkpoint.save")
SETS_UNDER = ("recipe.model", "recipe.optim", "recipe.schedule", "recipe.data", "train.precision", "train.grad_clip",
              "train.grad_accum", "train.max_steps", "train.epochs", "train.eval", "train.log_every",
              "graph.warmup_iters")
LOSS_NORMALIZATION = {
    "trl": "its fused LM head's summed token losses over the step's loss tokens (num_items_in_batch: labels that are "
           "not -100; logits computed only there)",
    "ours": "summed token losses over the step's loss tokens (Recipe.loss_average='labels')",
}


@dataclass(frozen=True)
class Plan:
    """One size's two runs and the files they share."""
    size: str
    work: Path
    context: int
    our_batch: int
    trl_batch: int
    steps: int
    warmup_steps: int
    attention: str
    trl_attention: str  # TRL's kernel: its padding-free batches change length every step (flex compiles per shape)
    graph: str
    compile_trl: bool
    liger: str  # TRL's use_liger_kernel: auto (where liger_kernel imports), on, off
    seed: int
    # this repo's runs, one per way of computing its head (--head-chunk x --head-loss-tokens), beside one TRL run
    heads: Tuple["Head", ...] = ()
    trl_pad_to: Optional[int] = None  # TRL's pad_to_multiple_of: its padding-free steps padded to one length

    @property
    def conversations(self) -> int:
        """Enough conversations for every step of the hungrier side, DATA_MARGIN over, its validation split kept."""
        from scripts.lib.chat_data import rendered_lengths

        mean = float(rendered_lengths(20_000, self.seed, self.context).mean())
        tokens = self.steps * max(self.our_batch, self.trl_batch) * self.context
        return max(50, math.ceil(DATA_MARGIN * tokens / mean / (1 - VAL_FRACTION)))

    @property
    def chats(self) -> Path:
        return self.work / f"chats_{self.conversations}_seed{self.seed}_max{self.context}.jsonl"

    @property
    def tokenizer(self) -> Path:
        return self.work / f"tokenizer_{self.chats.stem}"

    @property
    def tokens(self) -> Path:
        return self.work / f"tokens_{self.chats.stem}"

    @property
    def model(self) -> Path:
        return self.work / f"model_{self.size}_seed{self.seed}"

    @property
    def runs(self) -> Path:
        return self.work / "runs" / (f"{self.size}_{self.context}_ours{self.our_batch}_trl{self.trl_batch}_{self.attention}"
                                     + (f"_trl{self.trl_attention}" if self.trl_attention != self.attention else "")
                                     + (f"_trlpad{self.trl_pad_to}" if self.trl_pad_to else ""))


# ---- the commands -----------------------------------------------------------------------

def prepare_command(plan: Plan) -> List[str]:
    return [sys.executable, "scripts/prepare_text.py", str(plan.chats), "--input", "chat", "--tokenizer",
            str(plan.tokenizer), "--output", str(plan.tokens), "--val-fraction", str(VAL_FRACTION)]


def trl_command(plan: Plan, output: Path) -> List[str]:
    return [sys.executable, "-m", "scripts.lib.trl_worker", "--model", str(plan.model), "--tokenizer",
            str(plan.tokenizer), "--data", str(plan.chats), "--context", str(plan.context), "--batch",
            str(plan.trl_batch), "--steps", str(plan.steps), "--warmup-steps", str(plan.warmup_steps),
            "--attention", plan.trl_attention, "--liger", plan.liger, "--seed", str(plan.seed), "--output", str(output),
            *([] if plan.compile_trl else ["--no-compile"]),
            *(["--pad-to-multiple-of", str(plan.trl_pad_to)] if plan.trl_pad_to else [])]


@dataclass(frozen=True)
class Head:
    """How one of this repo's runs computes its LM head and loss."""
    chunk: Optional[int] = None  # recipe.model.head_chunk_tokens (None: the whole step's logits at once)
    loss_per_row: Optional[int] = None  # recipe.model.head_loss_tokens_per_row (None: at every token)

    @property
    def run_dir(self) -> str:
        return ("ours" + (f"_chunk{self.chunk}" if self.chunk is not None else "")
                + (f"_loss{self.loss_per_row}" if self.loss_per_row is not None else ""))

    @property
    def label(self) -> str:
        """The row's words after "this repo <graph>" (empty for the whole logits)."""
        return ((f", head in chunks of {self.chunk}" if self.chunk is not None else "")
                + (f", head at <= {self.loss_per_row} loss tokens a row" if self.loss_per_row is not None else ""))


def ours_overrides(plan: Plan, head: Head) -> List[str]:
    """train.py's settings for this repo's side: the matched optimizer, schedule, steps and data (MATCHED), with
    its head as ``head`` says."""
    return ["recipe=hf_causal_lm", "recipe.model.config=null", f"recipe.model.path={hydra_value(str(plan.model))}",
            f"recipe.model.context={plan.context}", "recipe.data.source=tokens",
            f"recipe.data.root={hydra_value(str(plan.tokens))}", f"recipe.data.batch_size={plan.our_batch}",
            "recipe.data.attention=document", f"recipe.data.attention_kernel={plan.attention}",
            f"recipe.model.head_chunk_tokens={hydra_value(head.chunk)}",
            f"recipe.model.head_loss_tokens_per_row={hydra_value(head.loss_per_row)}",
            f"recipe.optim.lr={MATCHED['lr']!r}",
            f"recipe.optim.betas={hydra_value(list(MATCHED['betas']))}",
            f"recipe.optim.weight_decay={MATCHED['weight_decay']!r}", f"+recipe.optim.eps={MATCHED['eps']!r}",
            "recipe.schedule._target_=trainer.step.schedules.Constant",
            f"recipe.schedule.warmup_steps={MATCHED['warmup_lr_steps']}", "~recipe.schedule.min_lr_ratio",
            "train.precision=bf16", f"train.grad_clip={MATCHED['max_norm']!r}", "train.grad_accum=1",
            f"train.max_steps={plan.steps}", "train.epochs=1000", "train.eval=false", "train.log_every=1",
            "train.progress=false", f"graph={plan.graph}", f"graph.warmup_iters={plan.warmup_steps - 1}",
            "checkpoint.save=false", "logger=none", f"seed={plan.seed}"]


def ours_command(plan: Plan, args: argparse.Namespace, head: Head) -> List[str]:
    return [sys.executable, "train.py", *args.train_options, *ours_overrides(plan, head), *args.overrides,
            f"run_dir={hydra_value(str(ours_run_dir(plan, head)))}"]


def ours_run_dir(plan: Plan, head: Head) -> Path:
    return plan.runs / head.run_dir


# ---- making the data, tokenizer and model ------------------------------------------------

def make_inputs(plan: Plan) -> None:
    """What both sides train on, made where it is not there yet (each is written whole, then renamed)."""
    from scripts.lib import chat_data

    plan.work.mkdir(parents=True, exist_ok=True)
    if not plan.chats.is_file():
        print(f"{SCRIPT}: writing {plan.conversations:,} conversations to {plan.chats}", flush=True)
        chat_data.write_conversations(plan.chats, plan.conversations, plan.seed, plan.context)
    for directory, marker, make in (
            (plan.tokenizer, "tokenizer.json", lambda d: chat_data.tokenizer_directory(d, plan.chats)),
            (plan.model, "config.json", lambda d: chat_data.model_directory(d, plan.size, plan.seed))):
        if not (directory / marker).is_file():
            print(f"{SCRIPT}: making {directory}", flush=True)
            partial = directory.with_name(directory.name + ".partial")
            make(partial)
            partial.replace(directory)
    if not (plan.tokens / "meta.json").is_file():
        run_or_exit(SCRIPT, f"[{plan.size}] prepare_text", prepare_command(plan), timeout=3600)


# ---- the rows ----------------------------------------------------------------------------

def trl_row(plan: Plan, status: str, result: Dict[str, Any], command: Sequence[str]) -> Dict[str, Any]:
    return {"run": "TRL SFTTrainer", "size": plan.size, "rows": plan.trl_batch, "context": plan.context,
            "attention": result.get("attention", f"document_attention ({plan.trl_attention})"),
            "compile": "torch_compile" if plan.compile_trl else "eager",
            "liger": result.get("liger"), "real_tokens_per_s": result.get("wall_real_tokens_per_s"),
            "real_tokens_per_step": result.get("real_tokens_per_step"),
            "loss_tokens_per_step": result.get("loss_tokens_per_step"),
            "padding_fraction": result.get("padding_fraction"), "step_ms_median": result.get("step_ms_median"),
            "wall_s": result.get("wall_s"), "wall_steps": result.get("wall_steps"),
            "peak_allocated_mib": result.get("peak_allocated_mib"),
            "peak_reserved_mib": result.get("peak_reserved_mib"), "losses": result.get("losses") or [],
            "status": status, "command": shlex.join(command[1:])}


def ours_row(plan: Plan, status: str, head: Head, command: Sequence[str]) -> Dict[str, Any]:
    run_dir = ours_run_dir(plan, head)
    results_file = run_dir / "results.json"
    r = json.loads(results_file.read_text()) if status == "ok" and results_file.is_file() else {}
    if status == "ok":  # flags a fallback to eager, or only warm-up steps timed
        status = comparison_rows([{"mode": plan.graph, "status": status, "results": r}])[0]["status"]
    real = r.get("perf/wall_real_tokens_per_s")
    return {"run": f"this repo {plan.graph}{head.label}", "head_chunk": head.chunk,
            "head_loss_tokens_per_row": head.loss_per_row, "size": plan.size, "rows": plan.our_batch,
            "context": plan.context,
            "attention": f"document_attention ({plan.attention})", "compile": plan.graph, "liger": False,
            "real_tokens_per_s": real,
            "real_tokens_per_step": real * r["perf/wall_s"] / r["perf/wall_steps"] if real and r.get("perf/wall_steps")
            else None,
            "loss_tokens_per_step": None, "padding_fraction": r.get("data/padding_fraction"),
            "step_ms_median": r.get("perf/step_ms_median"), "wall_s": r.get("perf/wall_s"),
            "wall_steps": r.get("perf/wall_steps"), "peak_allocated_mib": r.get("perf/peak_allocated_mib"),
            "peak_reserved_mib": r.get("perf/peak_reserved_mib"), "losses": logged_losses(run_dir, plan.steps),
            "status": status, "command": shlex.join(command[1:])}


def logged_losses(run_dir: Path, steps: int) -> List[Optional[float]]:
    """train/loss at each step 1..steps from the run's metrics.jsonl (train.log_every=1); None where missing."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return []
    by_step = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "train/loss" in row:
            by_step[row["step"]] = row["train/loss"]
    return [by_step.get(step) for step in range(1, steps + 1)]


def with_ratios(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each row's real tokens/s and peak allocated memory over TRL's (None where either is missing)."""
    trl = next((row for row in rows if row["run"].startswith("TRL")), {})

    def over(row: Dict[str, Any], key: str) -> Optional[float]:
        return row[key] / trl[key] if row.get(key) and trl.get(key) else None

    return [{**row, "vs_trl": over(row, "real_tokens_per_s"), "memory_vs_trl": over(row, "peak_allocated_mib"),
             "loss_first": next((v for v in row["losses"] if v is not None), None),
             "loss_last": next((v for v in reversed(row["losses"]) if v is not None), None)} for row in rows]


COLUMNS = [("run", "run", "{}"), ("rows", "rows x context", "{}"), ("attention", "attention", "{}"),
           ("compile", "compile", "{}"), ("liger", "Liger", "{}"),
           ("real_tokens_per_s", "real tokens/s", "{:,.0f}"), ("vs_trl", "vs TRL", "{:.2f}x"),
           ("real_tokens_per_step", "real tokens a step", "{:,.0f}"), ("padding_fraction", "padding", "{:.2%}"),
           ("step_ms_median", "step ms median", "{:,.1f}"), ("peak_allocated_mib", "peak allocated MiB", "{:,.0f}"),
           ("memory_vs_trl", "memory vs TRL", "{:.2f}x"), ("loss_first", "loss, step 1", "{:.3f}"),
           ("loss_last", "loss, last step", "{:.3f}"), ("status", "status", "{}")]


def cell(row: Dict[str, Any], key: str, form: str) -> str:
    value = row.get(key)
    if key == "rows":
        return f"{row['rows']} x {row['context']}"
    if key == "liger" and value is not None:
        return "yes" if value else "no"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return form.format(value).replace("|", "\\|")


def report(plan: Plan, rows: List[Dict[str, Any]], measured: Dict[str, Optional[str]], plot: Optional[str]) -> str:
    shape = SIZES[plan.size]
    lines = [f"## TRL SFTTrainer against this repo: `{plan.size}` on conversations, one {measured['gpu'] or 'GPU'}", "",
             markdown_table([header for _, header, _ in COLUMNS], [[cell(row, k, f) for k, _, f in COLUMNS]
                                                                    for row in rows]), "",
             f"- Model: Qwen2-shaped, {shape.num_hidden_layers} layers x {shape.hidden_size}, "
             f"{shape.num_attention_heads} heads / {shape.num_key_value_heads} KV heads, FFN {shape.intermediate_size}, "
             f"vocabulary {shape.vocab_size:,}, tied embeddings; random weights (scripts/lib/chat_data.py).",
             f"- Data: {plan.conversations:,} conversations (system + 1-4 exchanges), rendered lengths lognormal "
             f"around 300 tokens (sigma 1), {plan.context} at most; loss on the assistant's turns (content and "
             "<|im_end|>) on both sides, the same tokens and loss tokens per conversation.",
             f"- Steps: {plan.steps}, the first {plan.warmup_steps} not timed (this repo: {plan.warmup_steps - 1} "
             "eager warm-up steps and the capture); the loss read on the host every step on both sides.",
             "- Real tokens/s: tokens that are not padding in the timed steps over their wall window (the first timed "
             "step's start to the last one's end, CUDA events, trainer/metrics/perf.py WallWindow on both sides). "
             "vs TRL: this repo's real tokens/s (or peak allocated memory) over TRL's.",
             f"- Loss: TRL, {LOSS_NORMALIZATION['trl']}; this repo, {LOSS_NORMALIZATION['ours']}. One GPU, no "
             "gradient accumulation: the same normalization.",
             "- Attention: both sides this repo's document attention (recipes/hf_documents.py), "
             + (f"kernel `{plan.attention}`" if plan.trl_attention == plan.attention else
                f"this repo's kernel `{plan.attention}`, TRL's `{plan.trl_attention}`")
             + ", in TRL's model through transformers' AttentionInterface, its mask built "
             "once per forward from TRL's padding-free batch (scripts/lib/trl_worker.py).",
             "- LM head and loss: TRL, " + ("Liger's fused linear cross-entropy" if plan.liger == "on" else
                                            "the whole logits, or Liger's fused head where it imports (--liger auto)")
             + "; this repo, " + head_words(plan.heads) + ".",
             "- Not matched: the packing (TRL: best-fit decreasing over the whole set, rows of at most the context; "
             "this repo: best-fit decreasing in a shuffle buffer, rows of exactly the context), the order of the "
             "conversations, weight decay on biases and norms (TRL leaves them out; this repo decays every "
             "parameter), the warm-up's first step (TRL: lr 0 at step 1; this repo: lr/10)."]
    if plot:
        lines.append(f"- Loss curves: {plot}.")
    extra = ", ".join(f"{k} {measured[k]}" for k in ("trl", "datasets", "liger-kernel") if measured.get(k))
    lines += ["", f"{datetime.date.today().isoformat()}. " + provenance_line(measured)
              + (f" TRL side: {extra}." if extra else "")]
    return "\n".join(lines) + "\n"


def head_words(heads: Sequence[Head]) -> str:
    """How this repo's rows compute their LM head and loss."""
    if len(heads) == 1 and heads[0].loss_per_row is None:
        chunk = heads[0].chunk
        return ("the whole step's logits" if chunk is None
                else f"in chunks of {chunk} tokens (recipe.model.head_chunk_tokens)")
    return ("as each row says: the whole step's logits, or in chunks of that many tokens "
            "(recipe.model.head_chunk_tokens), at every token or at the loss tokens only, each packed row holding "
            "at most that many (recipe.model.head_loss_tokens_per_row)")


# ---- running -------------------------------------------------------------------------------

def run_size(plan: Plan, args: argparse.Namespace, measured: Dict[str, Optional[str]], output_dir: Path) -> List[tuple]:
    """Both sides of one size; writes its table. Returns (run, status) of each."""
    make_inputs(plan)
    plan.runs.mkdir(parents=True, exist_ok=True)
    trl_output = plan.runs / "trl.json"
    trl_output.unlink(missing_ok=True)
    command = trl_command(plan, trl_output)
    _, status = run_or_mark(SCRIPT, f"[{plan.size}] TRL", command, args.timeout, {"PYTHONUNBUFFERED": "1"},
                            log=plan.runs / "trl.log")
    result = json.loads(trl_output.read_text()) if status == "ok" and trl_output.is_file() else {}
    rows = [trl_row(plan, status, result, command)]

    for head in plan.heads:
        command = ours_command(plan, args, head)
        name = ours_run_dir(plan, head).name
        _, status = run_or_mark(SCRIPT, f"[{plan.size}] this repo ({name})", command, args.timeout,
                                {"PYTHONUNBUFFERED": "1"}, log=plan.runs / f"{name}.log")
        rows.append(ours_row(plan, status, head, command))
    rows = [{**row, "provenance": dict(measured)} for row in with_ratios(rows)]

    output = output_dir / f"trl_sft_{plan.size}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    plot = loss_plot(rows, output.with_name(f"{output.stem}_loss.png"))
    text = report(plan, rows, measured, plot)
    print("\n" + text, flush=True)
    plan_fields = {k: str(v) if isinstance(v, Path) else [vars(h) for h in v] if k == "heads" else v
                   for k, v in vars(plan).items()}
    write_json(output, {"date": datetime.date.today().isoformat(), "size": plan.size,
                        "shape": vars(SIZES[plan.size]), "plan": plan_fields, "conversations": plan.conversations,
                        "matched": MATCHED, "loss_normalization": LOSS_NORMALIZATION, "provenance": measured,
                        "rows": rows})
    output.with_suffix(".md").write_text(text)
    print(f"{SCRIPT}: wrote {output} and {output.with_suffix('.md').name}", flush=True)
    return [(f"[{plan.size}] {row['run']}", row["status"]) for row in rows]


def loss_plot(rows: List[Dict[str, Any]], path: Path) -> Optional[str]:
    """Both sides' loss at every step in one PNG; the Markdown that names it and its colours, or None when no side
    has a loss."""
    from scripts.lib.loss_plot import write_loss_plot

    curves = [(row["run"], row["losses"]) for row in rows if any(v is not None for v in row["losses"])]
    if not curves:
        return None
    colours = write_loss_plot(path, curves)["colours"]
    return f"`{path.name}` ({', '.join(f'{colour}: {run}' for run, colour in colours.items())})"


def plans(args: argparse.Namespace) -> List[Plan]:
    return [Plan(size, args.work.resolve(), args.context, args.our_batch, args.trl_batch, args.steps,
                 args.warmup_steps, args.attention, args.trl_attention or args.attention, args.graph,
                 not args.no_compile, args.liger, args.seed,
                 tuple(Head(chunk, loss) for chunk in dict.fromkeys(args.head_chunk)
                       for loss in dict.fromkeys(args.head_loss_tokens)), args.trl_pad_to)
            for size in dict.fromkeys(args.sizes)]


def head_chunk_value(text: str) -> Optional[int]:
    """A --head-chunk value: a positive integer, or none (the whole logits)."""
    return None if text.lower() in ("none", "null") else positive_int(text)


def positive_int(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (one line, exit 2) what cannot run or would break the match."""
    if args.warmup_steps < 2 or args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps {args.warmup_steps}: at least 2 (this repo's eager warm-up and its capture) "
                     f"and fewer than --steps {args.steps}")
    for override in args.overrides:
        key = override_key(override)
        if key in SETS or any(key == s or key.startswith(s + ".") for s in SETS_UNDER):
            parser.error(f"{override!r} is set by this script to match TRL's side: drop it (see {SCRIPT} --help)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=SCRIPT, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="train.py's overrides given here go to this repo's runs, after the "
                                            "script's own settings (those are refused: they keep the sides matched).")
    parser.error = lambda message: refuse(f"{SCRIPT}: {message}")  # one line, exit 2
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["0.5b", "1.5b"],
                        help="model shapes (default 0.5b 1.5b)")
    parser.add_argument("--steps", type=positive_int, default=60, help="steps a run, the untimed included (60)")
    parser.add_argument("--warmup-steps", type=positive_int, default=15, help="of them, not timed (15)")
    parser.add_argument("--context", type=positive_int, default=4096, help="tokens a packed row (4096)")
    parser.add_argument("--our-batch", type=positive_int, default=4, help="this repo's packed rows a step (4)")
    parser.add_argument("--trl-batch", type=positive_int, default=4,
                        help="TRL's per_device_train_batch_size: packed rows of at most --context tokens (4)")
    parser.add_argument("--attention", choices=KERNELS, default="varlen",
                        help="the document attention kernel of both sides (default varlen; dense: a CPU's)")
    parser.add_argument("--head-chunk", type=head_chunk_value, nargs="+", default=[None],
                        help="this repo's recipe.model.head_chunk_tokens: its LM head and loss this many tokens at a "
                             "time, or none for the whole step's logits (the default); several values run this repo "
                             "once each beside one TRL run, in one table: --head-chunk none 4096 2048")
    parser.add_argument("--head-loss-tokens", type=head_chunk_value, nargs="+", default=[None],
                        help="this repo's recipe.model.head_loss_tokens_per_row: its head at the loss tokens only, "
                             "each packed row holding at most this many, or none for every token (the default); "
                             "with several --head-chunk values, each pair runs: --head-chunk 4096 --head-loss-tokens "
                             "none 3072")
    parser.add_argument("--trl-pad-to", type=positive_int, default=None,
                        help="TRL's pad_to_multiple_of: each padding-free step padded to a multiple of this many "
                             "tokens (its rows x the context: one length every step, so flex and torch_compile "
                             "compile once; the padding is not counted as real tokens)")
    parser.add_argument("--trl-attention", choices=KERNELS, default=None,
                        help="TRL's kernel, where it differs from --attention: its padding-free batches change "
                             "length every step, and flex, compiled for one shape, recompiles at each (varlen "
                             "takes any length)")
    parser.add_argument("--graph", choices=graph_names(), default="full_compiled",
                        help="this repo's graph mode (default full_compiled)")
    parser.add_argument("--no-compile", action="store_true", help="TRL's torch_compile off")
    # off by default: liger-kernel 0.8.5's RMSNorm kernel failed to compile under torch_compile with torch 2.11 on an
    # H200 (Triton CompilationError, "'float' object has no attribute 'to'"), and the first step ran past 200 s
    parser.add_argument("--liger", choices=("auto", "on", "off"), default="off",
                        help="TRL's Liger kernels: auto (where liger_kernel imports, on a GPU), on, off (default: see "
                             "the comment above)")
    parser.add_argument("--seed", type=int, default=0, help="of the data, the weights and both runs (0)")
    parser.add_argument("--timeout", type=positive_int, default=1800, help="seconds one run may take (1800)")
    parser.add_argument("--work", type=Path, default=ROOT / "outputs" / "bench_trl",
                        help="the data, tokenizers, models and runs (default outputs/bench_trl; reused)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "scripts" / "results",
                        help="where trl_sft_<size>.json, .md and the loss PNG go (default scripts/results)")
    parser.add_argument("--dry-run", action="store_true", help="print what would run; make and run nothing")

    def checked(args: argparse.Namespace) -> List[str]:  # a typo in this repo's part fails here, before any run
        check(parser, args)
        plan = plans(args)[0]
        return ours_overrides(plan, plan.heads[-1])

    args, _ = script_config(parser, argv, defaults=checked)
    run_plans = plans(args)
    if args.dry_run:
        for plan in run_plans:
            print(f"[{plan.size}] data: {plan.conversations:,} conversations -> {plan.chats}; tokenizer "
                  f"{plan.tokenizer}; model {plan.model}")
            print(f"[{plan.size}] prepare: {shlex.join(prepare_command(plan))}")
            print(f"[{plan.size}] TRL: {shlex.join(trl_command(plan, plan.runs / 'trl.json'))}")
            for head in plan.heads:
                print(f"[{plan.size}] this repo: {shlex.join(ours_command(plan, args, head))}")
        return 0
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        refuse(f"{SCRIPT}: TRL's side needs trl, which this Python ({sys.executable}) cannot import: {INSTALL} "
               "(--dry-run shows both sides' commands without it)")
    cpu_only = (args.graph in CPU_MODES and args.attention == "dense" and args.trl_attention in (None, "dense")
                and args.no_compile)
    if not cpu_only and cuda_device_count() == 0:
        refuse(f"{SCRIPT}: no CUDA GPU here; on a CPU run both sides with --graph eager --attention dense "
               "--no-compile (--dry-run prints what would run)")
    exit_on_sigterm()
    measured = {**provenance(gpu_name()), **{p: installed(p) for p in ("trl", "datasets", "liger-kernel")}}
    statuses = [status for plan in run_plans for status in run_size(plan, args, measured, args.output_dir.resolve())]
    return exit_status(SCRIPT, statuses)


if __name__ == "__main__":
    sys.exit(main())
