"""The graph doctor on models from transformers (CUDA): its verdict agrees with what
graphing.GraphedStep really does with the same nanoGPT-style step.

transformers checks ``torch.cuda.is_current_stream_capturing()`` and skips host-side shortcuts
while a stream captures (its attention-mask and packed-sequence checks), so the eager steps the
doctor watches make host syncs that the graph never makes. The doctor judges those by its trial
capture: not in the graph, a note; a step whose capture and replays equal eager is not blocked.

For tiny Llama-, Qwen2- and GPT-2-style models (``AutoConfig.for_model`` +
``AutoModelForCausalLM.from_config``), bf16 autocast and a fused AdamW as a user builds it, each
with the config's default use_cache, with use_cache=False, and with an all-ones attention mask:

    doctor ready    <-> GraphedStep captures and its steps equal eager ones (within bf16 rounding)
    doctor blocked  <-> GraphedStep's capture fails

Run on the GPU machine: ``pytest -m gpu tests/test_doctor_hf_gpu.py -s`` (prints each case's
verdict, notes and time).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import graphing
from helpers.availability import needs_extra

pytestmark = [pytest.mark.gpu, pytest.mark.extras,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
transformers = needs_extra("transformers")

SIZES = {  # tiny, and each architecture's own names for the sizes
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
}
VARIANTS = ["use_cache_default", "use_cache_false", "all_ones_mask"]
VOCAB, BATCH, SEQ = 256, 4, 32
STEPS = 24  # per run: 11 eager warm-up calls, the capture, then replays
# Eager steps and graph replays of a library model may run different kernels (an explicit mask while
# capturing, none in eager steps): equal means within bf16 rounding, far below what a frozen or
# wrong step gives.
LOSS_RTOL = 2e-2
PARAMETER_RTOL = 0.25  # of how far the steps moved the parameters (all of them as one vector)


def build(arch: str, variant: str):
    """(step_fn, model, optimizer, next_inputs) as a nanoGPT-style loop over a transformers model has them."""
    torch.manual_seed(0)
    extra = {"use_cache": False} if variant == "use_cache_false" else {}
    config = transformers.AutoConfig.for_model(arch, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
                                               pad_token_id=0, **SIZES[arch], **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).cuda()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    with_mask = variant == "all_ones_mask"

    def step(model, x, y, mask):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x, attention_mask=mask if with_mask else None).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        return loss.detach()

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(6)]
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    position = [0]

    def next_inputs():
        tokens = data[position[0] % len(data)]
        position[0] += 1
        return tokens[:, :-1].cuda(), tokens[:, 1:].cuda(), mask.cuda()

    return step, model, optimizer, next_inputs


def run_steps(arch: str, variant: str, mode: str):
    """STEPS calls through GraphedStep: (losses, parameters at the start, parameters at the end)."""
    step_fn, model, optimizer, next_inputs = build(arch, variant)
    start = [p.detach().float().clone() for p in model.parameters()]
    step = graphing.GraphedStep(step_fn, model, optimizer, mode=mode)
    try:
        losses = [step(*next_inputs()).detach().float().clone() for _ in range(STEPS)]
        torch.cuda.synchronize()
    finally:
        step.close()
    return torch.stack(losses), start, [p.detach().float().clone() for p in model.parameters()]


def graphed_step_outcome(arch: str, variant: str) -> str:
    eager = run_steps(arch, variant, "eager")
    try:
        graphed = run_steps(arch, variant, "full")
    except Exception as err:  # CaptureError
        print(f"  GraphedStep: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
        return "fails"
    loss_difference = float(((eager[0] - graphed[0]).abs() / eager[0].abs()).max())
    # All parameters as one vector: a bias whose gradient is zero in exact arithmetic (Qwen2's k_proj) moves by
    # Adam-scaled noise alone, which differs between any two runs as much as it moved.
    moved = torch.cat([(end - begin).flatten() for begin, end in zip(eager[1], eager[2])]).norm()
    difference = torch.cat([(a - b).flatten() for a, b in zip(eager[2], graphed[2])]).norm()
    parameter_difference = float(difference / moved)
    print(f"  GraphedStep vs eager: loss {loss_difference:.2g} (relative), parameters {parameter_difference:.2g} "
          "(of how far they moved)")
    return "matches" if loss_difference <= LOSS_RTOL and parameter_difference <= PARAMETER_RTOL else "differs"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", sorted(SIZES))
def test_the_doctor_agrees_with_graphed_step_on_a_transformers_model(arch, variant):
    began = time.monotonic()
    step_fn, model, optimizer, next_inputs = build(arch, variant)
    report = graphing.diagnose(step_fn, model, optimizer, next_inputs)
    diagnosed = time.monotonic() - began
    outcome = graphed_step_outcome(arch, variant)
    print(f"{arch} {variant}: doctor {report.verdict} in {diagnosed:.1f} s; GraphedStep {outcome}; "
          f"{time.monotonic() - began:.1f} s in all\n  capture: {report.capture}"
          + "".join(f"\n  note: {n}" for n in report.notes))
    assert {"ready": "matches", "blocked": "fails"}.get(report.verdict) == outcome, report.table()
    # Every finding or note about a host sync names where it is: the library's line behind the user's.
    for finding in report.findings:
        assert finding.file == __file__ and finding.library_file, report.table()
    if report.verdict == "ready":
        assert report.capture.startswith("captured") and "replays equal eager" in report.capture, report.table()
