"""TRL's side of scripts/bench_trl.py: its SFTTrainer on the benchmark's conversations, in a process of its own.

    python -m scripts.lib.trl_worker --model DIR --tokenizer DIR --data chats.jsonl --context 4096 --batch 4 \
        --steps 60 --warmup-steps 15 --attention varlen --output result.json [--no-compile]

TRL's fastest settings on one GPU, read from TRL's SFTConfig (1.16): bf16 autocast over fp32 weights (TRL's own
default dtype for a model it loads), ``packing=True`` with ``packing_strategy="bfd"`` (best-fit decreasing, which turns
``padding_free`` on: each step's rows flattened into one sequence with its ``position_ids`` and ``cu_seq_lens_q/k``,
no padding), ``assistant_only_loss=True`` (the chat template's ``{% generation %}`` markers),
``max_length`` = the context, ``torch_compile=True``, gradient checkpointing off (TRL defaults it on:
``--gradient-checkpointing`` when memory needs it), Liger's kernels where ``liger_kernel`` imports (``--liger``),
fused AdamW with the benchmark's learning rate, betas, epsilon, weight decay, warm-up and gradient clipping
(``MATCHED``), ``--batch`` packed rows per step.

Attention: flash-attn is not installed, so the model gets this repo's own document attention
(recipes/hf_documents.py ``document_attention``, registered through transformers' ``AttentionInterface``) with the
kernel this repo's side uses (``--attention``): a forward pre-hook on the backbone turns TRL's padding-free batch
into one ``DocumentMask`` per forward, as this repo's step does: ``varlen`` reads TRL's ``cu_seq_lens_q``; ``flex``
and ``dense`` the documents that ``position_ids`` restarting at 0 mark. TRL's loss (its fused LM head, logits only
where a label counts) is its own.

Timed as train.py times this repo's side (trainer/metrics/perf.py): a TrainerCallback opens the wall window at the
first timed step's begin and marks each step's end with CUDA events; the first ``--warmup-steps`` are not timed. Each
step's real tokens (input ids that are not padding) and loss tokens are counted from its batch, on the device like its
loss, and read after the last step. Prints one JSON line of results last (and writes it to
``--output``). Without TRL it says how to install it and exits 2.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from scripts.lib.comparison import installed
from scripts.lib.refuse import refuse

INSTALL = ("pip install -r scripts/requirements-trl.txt (a machine without a package index: that file says which wheels "
           "to carry there)")
KERNELS = ("varlen", "flex", "dense")  # recipes/document_attention.py's, as recipe.data.attention_kernel names them
# The optimizer and schedule both sides train with (scripts/bench_trl.py gives this repo's side the same).
MATCHED = {"lr": 2e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "warmup_lr_steps": 10, "max_norm": 1.0}


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trl_worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a save_pretrained model directory")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a save_pretrained tokenizer directory")
    parser.add_argument("--data", type=Path, required=True, help="JSON Lines of {\"messages\": [...]}")
    parser.add_argument("--context", type=int, required=True, help="SFTConfig.max_length: tokens per packed row")
    parser.add_argument("--batch", type=int, required=True, help="per_device_train_batch_size: packed rows a step")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps in all, the warm-up's included")
    parser.add_argument("--warmup-steps", type=int, required=True, help="of --steps, the first ones, not timed")
    parser.add_argument("--attention", choices=KERNELS, default="varlen",
                        help="the document attention kernel (dense: the CPU's)")
    parser.add_argument("--lr", type=float, default=MATCHED["lr"])
    parser.add_argument("--no-compile", action="store_true", help="torch_compile off (a CPU run)")
    parser.add_argument("--liger", choices=("auto", "on", "off"), default="auto",
                        help="use_liger_kernel: auto = where liger_kernel imports, on a GPU")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--pad-to-multiple-of", type=int, default=None,
                        help="SFTConfig.pad_to_multiple_of (default none: each step its own length)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None,
                        help="TRL's output_dir and the datasets cache (default: beside --output)")
    parser.add_argument("--output", type=Path, required=True, help="where the JSON of results goes")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps {args.warmup_steps}: must leave at least one of --steps {args.steps} timed")
    return args


def document_mask_hook(kernel: str, context: int):
    """A forward pre-hook for the backbone: TRL's padding-free keywords in, this repo's DocumentMask (one per forward,
    read by every layer's ``document_attention``) added as the keyword ``document_mask``. varlen's bound on a
    sequence's length is the context, as this repo's (no packed sequence is longer than TRL's max_length)."""
    import torch

    from recipes.document_attention import DocumentMask

    def hook(module, args, kwargs):
        position_ids = kwargs["position_ids"]  # [1, tokens]: 0 where each packed sequence (or padding token) starts
        if kernel == "varlen":
            mask = DocumentMask("varlen", 1, context, kwargs["cu_seq_lens_q"].to(torch.int32))
        else:
            document_ids = (position_ids == 0).cumsum(-1, dtype=torch.int32) - 1
            mask = DocumentMask.build(document_ids, None, kernel)
        return args, {**kwargs, "document_mask": mask}

    return hook


def load_model(args: argparse.Namespace):
    """The model in fp32 (TRL's default dtype for one it loads), its attention this repo's document attention."""
    import torch
    import transformers

    from recipes.hf_documents import use_document_attention

    model = transformers.AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32,
                                                              local_files_only=True)
    use_document_attention(model, transformers, plain_causal=True)
    model.get_decoder().register_forward_pre_hook(document_mask_hook(args.attention, args.context),
                                                      with_kwargs=True)
    return model


def sft_config(args: argparse.Namespace, cuda: bool, liger: bool):
    from trl import SFTConfig

    b1, b2 = MATCHED["betas"]
    return SFTConfig(
        output_dir=str(args.work), report_to="none", save_strategy="no", logging_steps=1, seed=args.seed,
        max_steps=args.steps, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        bf16=cuda, use_cpu=not cuda, torch_compile=cuda and not args.no_compile,
        gradient_checkpointing=args.gradient_checkpointing, use_liger_kernel=liger,
        packing=True, packing_strategy="bfd", padding_free=True, max_length=args.context,
        pad_to_multiple_of=args.pad_to_multiple_of, assistant_only_loss=True,
        optim="adamw_torch_fused" if cuda else "adamw_torch", learning_rate=args.lr, adam_beta1=b1, adam_beta2=b2,
        adam_epsilon=MATCHED["eps"], weight_decay=MATCHED["weight_decay"], max_grad_norm=MATCHED["max_norm"],
        lr_scheduler_type="constant_with_warmup", warmup_steps=MATCHED["warmup_lr_steps"])


def make_trainer(model, tokenizer, dataset, config, counts: "StepCounts", callbacks):
    """TRL's SFTTrainer, its training_step counting each batch's tokens and keeping its loss (nothing else changed)."""
    from trl import SFTTrainer

    class CountingSFTTrainer(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            counts.add(inputs, tokenizer.pad_token_id)
            loss = super().training_step(model, inputs, num_items_in_batch)
            counts.losses.append(loss)
            return loss

    return CountingSFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                              callbacks=callbacks)


class StepCounts:
    """Per step: its input tokens, real tokens (not padding), loss tokens, and its loss. The batch is on the GPU
    already (accelerate's loader moves it): the counts stay there too, read once after the last step (``read``)."""

    def __init__(self):
        self.inputs: List[int] = []
        self.real: List[Any] = []
        self.loss_tokens: List[Any] = []
        self.losses: List[Any] = []

    def add(self, batch: Dict[str, Any], pad_id: int) -> None:
        ids, labels = batch["input_ids"], batch["labels"]
        self.inputs.append(ids.numel())
        self.real.append((ids != pad_id).sum())
        self.loss_tokens.append((labels[:, 1:] != -100).sum())  # a label scores the token before it

    def read(self) -> None:
        """The counts and losses as Python numbers (one host sync)."""
        import torch

        for name in ("real", "loss_tokens", "losses"):
            values = getattr(self, name)
            setattr(self, name, torch.stack(values).tolist() if values else [])


def step_clock(device, warmup_steps: int):
    """A TrainerCallback timing steps as train.py does (trainer/metrics/perf.py Perf): the wall window from the first
    timed step's begin to the last one's end, step times between step ends, a metric read (TRL logs every step) left
    out of the step times and kept in the window."""
    from transformers import TrainerCallback

    from trainer.metrics.perf import Perf

    class StepClock(TrainerCallback):
        def __init__(self):
            self.perf = Perf(device, units_per_step=1.0, unit="steps", world_size=1, flops_per_unit=0.0, precision="")

        @staticmethod
        def phase(step: int) -> str:
            return "timed" if step > warmup_steps else "warmup"

        def on_step_begin(self, args, state, control, **kwargs):
            self.perf.begin(self.phase(state.global_step + 1))

        def on_step_end(self, args, state, control, **kwargs):
            self.perf.step(self.phase(state.global_step))  # global_step counts the step that just ended

        def on_log(self, args, state, control, **kwargs):
            self.perf.timer.restart()

    return StepClock()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        refuse(f"trl_worker: TRL's side needs trl and datasets, which this Python ({sys.executable}) cannot import: "
               f"{INSTALL}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never ask the hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets
    import torch
    import transformers
    import trl

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.attention != "dense" and not cuda:
        refuse(f"trl_worker: --attention {args.attention} trains on CUDA only: give --attention dense on a CPU")
    liger = cuda and args.liger != "off" and importlib.util.find_spec("liger_kernel") is not None
    if args.liger == "on" and not liger:
        refuse("trl_worker: --liger on: liger_kernel does not import here (or there is no GPU): pip install "
               "liger-kernel, or --liger auto")
    args.work = args.work or args.output.parent / f"{args.output.stem}_trl"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(args.tokenizer), local_files_only=True)
    dataset = datasets.load_dataset("json", data_files=str(args.data), split="train",
                                    cache_dir=str(args.work / "datasets"))
    model = load_model(args)
    parameters = sum(p.numel() for p in model.parameters())
    counts = StepCounts()
    clock = step_clock(device, args.warmup_steps)
    config = sft_config(args, cuda, liger)
    trainer = make_trainer(model, tokenizer, dataset, config, counts, [clock])
    packed_rows = len(trainer.train_dataset)
    trainer.train()

    summary = clock.perf.phase_summary("timed")
    counts.read()
    timed = slice(args.warmup_steps, args.steps)
    real_timed = sum(counts.real[timed])
    wall_s = summary.get("wall_s")
    result: Dict[str, Any] = {
        "side": "trl", "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
        "datasets": datasets.__version__, "liger_kernel": installed("liger-kernel") if liger else None,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "attention": f"document_attention ({args.attention})",  # this repo's, through AttentionInterface
        "liger": liger, "torch_compile": config.torch_compile, "gradient_checkpointing": args.gradient_checkpointing,
        "batch": args.batch, "context": args.context, "steps": args.steps, "warmup_steps": args.warmup_steps,
        "parameters": parameters, "packed_rows": packed_rows,
        **{key: summary.get(key) for key in ("step_ms_median", "step_ms_p90", "step_ms_mean", "steps_timed",
                                             "wall_s", "wall_steps")},
        "real_tokens_timed": real_timed,
        "wall_real_tokens_per_s": real_timed / wall_s if wall_s else None,
        "real_tokens_per_step": real_timed / len(counts.real[timed]) if counts.real[timed] else None,
        "loss_tokens_per_step": (sum(counts.loss_tokens[timed]) / len(counts.loss_tokens[timed])
                                 if counts.loss_tokens[timed] else None),
        "padding_fraction": 1.0 - real_timed / max(sum(counts.inputs[timed]), 1),
        "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
        "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20 if cuda else None,
        "losses": counts.losses,
        "settings": {key: getattr(config, key) for key in (
            "packing", "packing_strategy", "padding_free", "max_length", "pad_to_multiple_of", "assistant_only_loss",
            "bf16", "torch_compile", "use_liger_kernel", "gradient_checkpointing", "optim", "learning_rate",
            "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm", "lr_scheduler_type",
            "warmup_steps", "per_device_train_batch_size", "max_steps", "logging_steps", "seed")},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
