"""The LM head and its loss a chunk of tokens at a time (recipes/chunked_head.py, recipe.model.head_chunk_tokens):
the same loss, gradients and top-1 as the whole step's logits, and hf_causal_lm training alike either way."""
from __future__ import annotations

import pytest
import torch

from recipes.chunked_head import chunked_head_criterion, pass_hidden_states_through
from recipes.gpt import next_token_criterion
from trainer.recipe import IGNORE_INDEX, top1_correct


def case(dtype=torch.float64, rows=3, tokens=11, hidden=16, vocab=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g, dtype=torch.float64))
    x = torch.randn(rows, tokens, hidden, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows, tokens), generator=g)
    target[0, 3] = target[2, :] = IGNORE_INDEX  # a prompt token, and a whole row of them (a chunk with no label)
    return head, x, target


def unchunked(head, x, target, smoothing, reduction):
    logits = x @ head.weight.to(x.dtype).T
    return next_token_criterion(smoothing)(logits, target, reduction=reduction), logits


@pytest.mark.fast
@pytest.mark.parametrize("chunk", [1, 5, 11, 1000])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_loss_gradients_and_top1_equal_the_whole_logits_from_fp64_inputs(chunk, smoothing, reduction):
    """Both sides take the loss in fp32 from the logits, as the recipe does: equal to fp32's rounding."""
    head, x, target = case()
    loss, correct = chunked_head_criterion(head, chunk, smoothing).with_top1(x, target, reduction=reduction)
    (3.0 * loss).backward()  # a scale from outside (the step's 1 / loss tokens) reaches both gradients
    got = loss.detach(), x.grad.clone(), head.weight.grad.clone()
    x.grad = head.weight.grad = None
    ref, logits = unchunked(head, x, target, smoothing, reduction)
    (3.0 * ref).backward()
    assert got[0].item() == pytest.approx(ref.item(), rel=1e-6)  # fp32 loss arithmetic on both sides
    assert torch.allclose(got[1], x.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got[2], head.weight.grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, top1_correct(logits.detach().float(), target))


def test_inside_torch_compile_each_chunk_compiles_alone_and_gives_the_eager_results():
    """In a compiled step (graph=full_compiled) the chunk loop runs outside the traced graph and one chunk's pass is
    compiled for all chunks (a last, shorter chunk its own): Inductor never sees the chunks side by side."""
    from recipes import chunked_head

    head, x, target = case()
    x, head = x.detach().float().requires_grad_(), head.float()
    criterion = chunked_head_criterion(head, 5, 0.1)
    chunked_head.COMPILED.clear()
    results = {}
    for name, fn in (("eager", criterion.with_top1), ("compiled", torch.compile(criterion.with_top1, dynamic=False))):
        x.grad = head.weight.grad = None
        loss, correct = fn(x, target, reduction="sum")
        loss.backward()
        losses = (torch.compile(criterion, dynamic=False) if name == "compiled" else criterion)(x.detach(), target)
        results[name] = (loss.detach(), correct, x.grad.clone(), head.weight.grad.clone(), losses)
    for got, want in zip(results["compiled"], results["eager"]):
        assert got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # the compiled step took the per-chunk compiled passes (made on first use), the eager one did not
    assert set(chunked_head.COMPILED) == {chunked_head._chunk_pass, chunked_head._chunk_losses}


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_compiled_the_logits_gradient_is_one_pass_without_a_scatter_and_equals_the_eager_one(smoothing):
    """The label's -1 in d loss / d logits: eager a scatter in place, compiled a comparison with the column index,
    which Inductor fuses into the one pass that writes the gradient (the scatter made it write the fp32 softmax
    and read it back). Both give the same numbers."""
    from torch._inductor.utils import run_and_get_code

    from recipes.chunked_head import _softmax_minus_target

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 500, generator=g)
    target = torch.randint(0, 500, (64,), generator=g)
    target[::5] = IGNORE_INDEX
    kept, lse = target != IGNORE_INDEX, logits.logsumexp(-1)
    eager = _softmax_minus_target(logits, lse, target, kept, smoothing)
    torch._dynamo.reset()
    compiled, code = run_and_get_code(torch.compile(_softmax_minus_target, dynamic=False), logits, lse, target, kept,
                                      smoothing)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-7)
    assert not any("scatter" in c or "atomic_add" in c for c in code), code
    softmax = torch.softmax(logits, -1) - smoothing / 500
    softmax[torch.arange(64), target.clamp(min=0)] -= 1 - smoothing
    torch.testing.assert_close(eager, torch.where(kept[:, None], softmax, 0.0), rtol=0, atol=1e-6)


@pytest.mark.fast
def test_bf16_hidden_states_give_the_whole_logits_gradients_to_bf16_rounding():
    """Under autocast the head runs in bf16: the hidden states' gradient is the same matmul, the weight's sums the
    chunks in fp32 (the whole-logits one rounds its single product to bf16)."""
    head, x, target = case(torch.bfloat16, rows=4, tokens=64, hidden=32, vocab=300)
    loss = chunked_head_criterion(head, 48).with_top1(x, target, reduction="sum")[0]
    loss.backward()
    got = loss.detach(), x.grad.float(), head.weight.grad.clone()
    x.grad = head.weight.grad = None
    ref = unchunked(head, x, target, 0.0, "sum")[0]
    ref.backward()
    assert got[0].item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(got[1], x.grad.float(), rtol=2e-2, atol=1e-2)
    scale = head.weight.grad.abs().max()
    assert (got[2] - head.weight.grad).abs().max() <= 1e-2 * scale


@pytest.mark.fast
def test_under_autocast_the_head_hands_the_loss_its_hidden_states_in_autocasts_dtype():
    """The loss runs outside autocast: the head, called inside the model's autocast forward, casts the hidden states
    as its own matmul would have, so the chunks' matmuls run in bf16 (they ran in fp32: 3x slower on an H200)."""
    head = torch.nn.Linear(8, 5, bias=False)
    pass_hidden_states_through(head)
    x = torch.randn(2, 8, requires_grad=True)
    assert head(x) is x  # no autocast: as given
    with torch.autocast("cpu", dtype=torch.bfloat16):
        passed = head(x)
    assert passed.dtype == torch.bfloat16 and torch.equal(passed, x.to(torch.bfloat16))
    (passed.float() * 3).sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, torch.full_like(x, 3.0))
    assert set(head.state_dict()) == {"weight"}


@pytest.mark.fast
@pytest.mark.parametrize("per_row", [11, 7], ids=["room-to-spare", "exactly-full"])
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_the_head_at_the_loss_tokens_only_equals_the_whole_logits(per_row, chunk, reduction):
    """recipe.model.head_loss_tokens_per_row: 3 rows of 11 tokens, 21 of them loss tokens, in 3 * per_row slots
    (33: 12 unused, read as position 0 with no label; 21: every slot used). Loss, both gradients and the top-1 of
    every position (False at the positions without a label, as the whole logits judge them) are the whole
    logits', in fp64 inputs to fp32's rounding."""
    head, x, target = case()
    with torch.no_grad():
        target[1, :4] = (x[1, :4] @ head.weight.T).argmax(-1)  # four labels the model predicts
    assert (target != IGNORE_INDEX).sum() == 21
    loss, correct = chunked_head_criterion(head, chunk, 0.1, per_row).with_top1(x, target, reduction=reduction)
    (3.0 * loss).backward()
    got = loss.detach(), x.grad.clone(), head.weight.grad.clone()
    x.grad = head.weight.grad = None
    ref, logits = unchunked(head, x, target, 0.1, reduction)
    (3.0 * ref).backward()
    assert got[0].item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(got[1], x.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got[2], head.weight.grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, top1_correct(logits.detach().float(), target))
    assert correct[1, :4].all()  # not vacuous: the predicted labels read back at their positions


@pytest.mark.fast
def test_more_loss_tokens_than_the_slots_make_the_loss_and_gradients_nan_never_a_partial_loss():
    """21 loss tokens, 3 rows of at most 6: the packer never makes such a batch, and were one to reach the head,
    training on 18 of its 21 labels would differ from eager's whole logits without a word. The loss and the
    gradients it gives are NaN instead, which stops the run (trainer.NonFiniteLossError names the step)."""
    head, x, target = case()
    loss = chunked_head_criterion(head, 4, 0.0, 6).with_top1(x, target, reduction="sum")[0]
    loss.backward()
    assert loss.isnan() and head.weight.grad.isnan().all()
    assert x.grad[target != IGNORE_INDEX][:18].isnan().all()  # every hidden state the head read


def test_the_head_at_the_loss_tokens_compiled_equals_it_eager():
    """graph=full_compiled traces the loss positions' gather (cumsum, scatter, index) into the step's graph; the
    chunk loop stays outside it as without the bound."""
    head, x, target = case()
    x, head = x.detach().float().requires_grad_(), head.float()
    criterion = chunked_head_criterion(head, 5, 0.1, 8)
    results = {}
    for name, fn in (("eager", criterion.with_top1), ("compiled", torch.compile(criterion.with_top1, dynamic=False))):
        x.grad = head.weight.grad = None
        loss, correct = fn(x, target, reduction="mean")
        loss.backward()
        results[name] = (loss.detach(), correct, x.grad.clone(), head.weight.grad.clone())
    for got, want in zip(results["compiled"], results["eager"]):
        assert got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.fast
def test_loss_positions_lists_the_counted_labels_in_order_in_fixed_slots():
    from recipes.chunked_head import loss_positions

    target = torch.tensor([IGNORE_INDEX, 5, 6, IGNORE_INDEX, 7, IGNORE_INDEX])
    index, used = loss_positions(target, 5)
    assert index.tolist() == [1, 2, 4, 0, 0] and used.tolist() == [True, True, True, False, False]
    index, used = loss_positions(target, 2)  # too few slots: the first two (the caller poisons the loss)
    assert index.tolist() == [1, 2] and used.tolist() == [True, True]


def test_per_token_losses_for_evaluation_and_with_gradients_for_a_partial_batch():
    head, x, target = case()
    criterion = chunked_head_criterion(head, 4, 0.1)
    ref, logits = unchunked(head, x, target, 0.1, "none")
    with torch.no_grad():
        assert torch.allclose(criterion(x, target, reduction="none"), ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(criterion.top1(x, target), top1_correct(logits.float(), target))
    kept = torch.tensor([True, False, True]).unsqueeze(-1).expand_as(target)  # the step's masked sum of a tail
    torch.where(kept, criterion(x, target, reduction="none"), 0.0).sum().backward()
    got = x.grad.clone()
    x.grad = None
    torch.where(kept, unchunked(head, x, target, 0.1, "none")[0], 0.0).sum().backward()
    assert torch.allclose(got, x.grad, rtol=1e-5, atol=1e-5)


transformers_needed = pytest.mark.extras
TINY = ["recipe=hf_causal_lm", "experiment=debug", "logger=none", "recipe.data.train_size=64",
        "recipe.data.test_size=32", "train.precision=fp32", "train.max_steps=6", "train.log_every=2"]


TIED_GPT2 = ["recipe.model.config=null", "+recipe.model.config={model_type:gpt2,n_embd:32,n_layer:2,n_head:4,"
             "n_positions:64,vocab_size:256,resid_pdrop:0.0,embd_pdrop:0.0,attn_pdrop:0.0}"]


TRAINED = ("final/loss", "final/eval_loss", "final/accuracy", "final/grad_norm")  # what two runs must agree on


def results_of(runs, *names):
    """Each named run's results.json, once every run ended with 0."""
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-3000:]
    return [runs[name].results() for name in names]


def assert_trained_alike(results, reference, keys=TRAINED):
    for key in keys:
        assert results[key] == pytest.approx(reference[key], rel=1e-4), key


@transformers_needed
@pytest.mark.parametrize("model", [[], TIED_GPT2], ids=["llama_untied", "gpt2_tied"])
def test_hf_causal_lm_trains_alike_with_the_head_in_chunks(train_here, tmp_path, model):
    from helpers.availability import needs_extra

    needs_extra("transformers")
    runs = {chunk: train_here([*TINY, *model, f"recipe.model.head_chunk_tokens={chunk}"], tmp_path / str(chunk))
            for chunk in ("null", "100")}
    whole, chunked = results_of(runs, "null", "100")
    assert_trained_alike(chunked, whole, (*TRAINED, "final/eval_accuracy"))


@transformers_needed
def test_hf_causal_lm_trains_alike_with_the_head_at_the_loss_tokens_only(train_here, tmp_path):
    """recipe.model.head_loss_tokens_per_row on prompt/completion pairs (about half the tokens carry loss): at the
    context (64: the packing is the unbounded one, the head reads the loss tokens in slots of which some stay
    unused) the run trains as with the whole logits; at 40 each row holds at most 40 loss tokens, the log and
    results say so, and the run trains."""
    from helpers.availability import needs_extra

    from helpers.documents import pairs_directory

    needs_extra("transformers")
    data = [f"recipe.data.root={pairs_directory(tmp_path)}", "recipe.data.source=tokens",
            "recipe.data.train_size=null", "recipe.data.test_size=null"]
    runs = {bound: train_here([*TINY, *data, f"recipe.model.head_loss_tokens_per_row={bound}"], tmp_path / bound)
            for bound in ("null", "64", "40")}
    whole, at_loss, bounded = results_of(runs, "null", "64", "40")
    assert_trained_alike(at_loss, whole, (*TRAINED, "final/eval_accuracy"))
    assert whole["data/loss_tokens"] < 0.7 * whole["data/real_tokens"]  # prompts carry none: fewer logits
    assert "(at most 40 a row)" in runs["40"].stdout and bounded["data/loss_tokens_per_row_bound"] == 40
    assert bounded["data/loss_tokens"] == whole["data/loss_tokens"]  # nothing dropped
    assert bounded["final/loss"] == pytest.approx(whole["final/loss"], rel=0.2)  # the same data, other rows


@transformers_needed
@pytest.mark.parametrize("overrides, message", [
    (["recipe.model.head_chunk_tokens=0"], "recipe.model.head_chunk_tokens=0 must be a positive integer"),
    (["recipe.model.head_loss_tokens_per_row=65"], "recipe.model.head_loss_tokens_per_row=65 must be an integer "
     "from 1 to recipe.model.context=64"),
    (["recipe.model.head_loss_tokens_per_row=32"], "recipe.model.head_loss_tokens_per_row=32 bounds the loss tokens "
     "of packed rows of documents, and recipe.data.source=synthetic gives windows of one stream"),
    (["recipe.model.head_chunk_tokens=64", "train.parallel=fsdp2"],
     "recipe.model.head_chunk_tokens=64 cannot be used with train.parallel=fsdp2 with its root resharded after "
     "forward (the head's weight is sharded again before the loss reads it; set train.fsdp.root=gathered)"),
])
def test_a_head_chunk_setting_that_cannot_work_is_refused_naming_it(train_here, overrides, message):
    from helpers.availability import needs_extra

    needs_extra("transformers")
    done = train_here([*TINY, *overrides])
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


FSDP2_GATHERED_ROOT = ["train.parallel=fsdp2", "train.fsdp.root=gathered"]


@transformers_needed
@pytest.mark.parametrize("parallel,model", [([], []), (FSDP2_GATHERED_ROOT, []), (FSDP2_GATHERED_ROOT, TIED_GPT2)],
                         ids=["ddp_llama_untied", "fsdp2_llama_untied", "fsdp2_gpt2_tied"])
def test_two_gloo_ranks_train_alike_with_the_head_in_chunks(tmp_path, parallel, model):
    """The loss reads the head's weight outside the wrapped forward. Under DDP its gradient still reaches the
    all-reduce; under FSDP2 the root unit holds the head, kept gathered after forward (train.fsdp.root=gathered), so
    the loss reads the whole weight and FSDP2 reduce-scatters the gradient the loss hands it. Both ranks train as
    with the whole logits."""
    from helpers.availability import needs_extra
    from helpers.launches import launch_together

    needs_extra("transformers")
    args = [a for a in TINY if a != "recipe=hf_causal_lm"]
    runs = launch_together({c: ["recipe=hf_causal_lm", *args, *model, *parallel, f"recipe.model.head_chunk_tokens={c}"]
                            for c in ("null", "50")}, tmp_path, nproc=2, timeout=240)
    whole, chunked = results_of(runs, "null", "50")
    assert whole["world_size"] == chunked["world_size"] == 2
    assert_trained_alike(chunked, whole)


@transformers_needed
def test_two_gloo_ranks_under_fsdp2_train_alike_with_the_head_at_the_loss_tokens_only(tmp_path):
    """recipe.model.head_loss_tokens_per_row at the context (the unbounded packing) under FSDP2 with the root kept
    gathered: each rank gathers its own micro-batch's loss positions, and the loss over both ranks' loss tokens and
    the gradients FSDP2 reduce-scatters are the whole logits'."""
    from helpers.availability import needs_extra
    from helpers.documents import pairs_directory
    from helpers.launches import launch_together

    needs_extra("transformers")
    data = [f"recipe.data.root={pairs_directory(tmp_path)}", "recipe.data.source=tokens",
            "recipe.data.train_size=null", "recipe.data.test_size=null"]
    args = ["recipe=hf_causal_lm", *[a for a in TINY if a != "recipe=hf_causal_lm"], *data, *FSDP2_GATHERED_ROOT]
    runs = launch_together({bound: [*args, f"recipe.model.head_loss_tokens_per_row={bound}"]
                            for bound in ("null", "64")}, tmp_path / "runs", nproc=2, timeout=240)
    whole, at_loss = results_of(runs, "null", "64")
    assert whole["world_size"] == at_loss["world_size"] == 2
    assert_trained_alike(at_loss, whole)


@pytest.mark.fast
def test_a_sharded_head_weight_is_refused_not_read_as_a_slice_of_the_vocabulary():
    """Where a user's own FSDP2 layout reshards the head before the loss, the criterion says so (never a loss over
    a shard's rows)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard

    from recipes.chunked_head import chunked_head_criterion, pass_hidden_states_through

    head = torch.nn.Linear(8, 32, bias=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        head.weight = torch.nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Shard(0)]))
        criterion = chunked_head_criterion(head, chunk=4)
        with pytest.raises(RuntimeError, match=r"found the head's weight sharded .*\(train.fsdp.root=gathered"):
            criterion(torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.long), reduction="sum")
    finally:
        dist.destroy_process_group()
