"""recipe=hf_causal_lm on a GPU: llama-, qwen2- and gpt2-style transformers models train under
graph=full as they do under graph=eager, step for step, and run in every other graph mode.

Run on the GPU machine: ``pytest -m gpu tests/test_hf_causal_lm_gpu.py``. Skipped without CUDA or
without transformers; the two-rank case needs two GPUs.
"""
from __future__ import annotations

import math

import pytest

from helpers.availability import cuda_count, needs_extra
from helpers.launches import launch

pytestmark = [pytest.mark.gpu, pytest.mark.extras, pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")]
needs_extra("transformers")
two_gpus = pytest.mark.skipif(cuda_count() < 2, reason="needs 2 GPUs")

STEPS = 30  # > graph.warmup_iters (11): about 18 of them replay the captured graph
# Tiny models of each family, dropout off (a replay draws other random numbers than an eager step).
MODELS = {
    "llama": dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=256, vocab_size=256, max_position_embeddings=128),
    "qwen2": dict(model_type="qwen2", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=256, vocab_size=256, max_position_embeddings=128),
    "gpt2": dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, n_positions=128, vocab_size=256,  # tied head
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}
# bf16 (the recipe's precision), AdamW, grad clipping; 1024 windows of 128 bytes: all STEPS in one epoch.
COMMON = ["recipe=hf_causal_lm", "experiment=debug", "logger=none", "train.progress=false", "train.log_every=5",
          f"train.max_steps={STEPS}", "recipe.model.context=128", "recipe.data.train_size=1024",
          "recipe.data.test_size=96", "recipe.data.batch_size=16", "recipe.data.eval_batch_size=32",
          "recipe.optim.lr=1e-3", "recipe.schedule.warmup_steps=5"]
SAME_RUNS = [*COMMON, "deterministic=true"]  # deterministic kernels (cuBLAS workspace) for eager against graph
# Graph and eager run the same model on the same data from the same seed, with the same attention kernel
# (recipes/hf_causal_lm.py CAUSAL_SDPA: no mask built in either). Measured on an H100 (torch 2.11,
# transformers 5.17) while the captured step still built the causal mask (another kernel, other bf16
# rounding): at most 2e-5 for all three models. A graph that replays stale inputs or skips the optimizer
# moves these numbers by 1e-2 and more.
REL_TOLERANCE = 2e-3


def model(name: str):
    """The overrides that replace the recipe's model config with ``MODELS[name]`` whole."""
    body = ",".join(f"{key}:{value}" for key, value in MODELS[name].items())
    return ["recipe.model.config=null", f"+recipe.model.config={{{body}}}"]


def train_losses(done):
    return [(row["step"], row["train/loss"]) for row in done.metrics() if "train/loss" in row]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_full_graph_trains_like_eager_from_the_same_seed(out, name):
    eager = launch([*SAME_RUNS, *model(name), "graph=eager"], out / "eager", timeout=600)
    graph = launch([*SAME_RUNS, *model(name), "graph=full"], out / "full", timeout=600)
    for done in (eager, graph):
        assert done.returncode == 0, done.output[-4000:]
    e, g = eager.results(), graph.results()
    assert (e["mode"], g["mode"]) == ("eager", "full") and e["steps"] == g["steps"] == STEPS
    assert g["timed_phase"] == "graph" and g["graph/train_capture_s"] > 0 and g["graph/eval_capture_s"] > 0
    assert e["precision"] == g["precision"] == "bf16"

    why = f"eager {train_losses(eager)}\ngraph {train_losses(graph)}"
    assert [s for s, _ in train_losses(eager)] == [s for s, _ in train_losses(graph)], why
    for (step, le), (_, lg) in zip(train_losses(eager), train_losses(graph)):
        assert math.isfinite(le) and lg == pytest.approx(le, rel=REL_TOLERANCE), f"train loss at step {step}\n{why}"
    assert g["final/eval_tokens"] == e["final/eval_tokens"] == 96 * 128
    assert g["final/eval_loss"] == pytest.approx(e["final/eval_loss"], rel=REL_TOLERANCE), why
    losses = [loss for _, loss in train_losses(graph)]
    assert losses[-1] < losses[0] - 0.5, f"no training progress: {why}"  # chance is ln 256 = 5.55


@pytest.mark.parametrize("graph,mode", [("partial", "partial"), ("compile", "compile"),
                                        ("full_compiled", "full")])
def test_the_other_graph_modes_train_a_transformers_model(out, graph, mode):
    """graph.mode=partial replays the model called with its token ids positionally; compile and
    full_compiled compile it (full_compiled inside the whole-step graph)."""
    done = launch([*COMMON, *model("llama"), f"graph={graph}", "train.max_steps=16"], out, timeout=600)
    assert done.returncode == 0, done.output[-4000:]
    res = done.results()
    assert res["mode"] == mode and res["steps"] == 16
    assert math.isfinite(res["final/loss"]) and math.isfinite(res["final/eval_loss"])
    if mode != "compile":
        assert res["timed_phase"] == "graph"


@two_gpus
def test_two_ranks_under_ddp_train_graphed_like_eager(out):
    args = [*SAME_RUNS, *model("llama"), "recipe.data.batch_size=8"]
    eager = launch([*args, "graph=eager"], out / "eager", nproc=2, timeout=600)
    graph = launch([*args, "graph=full"], out / "full", nproc=2, timeout=600)
    for done in (eager, graph):
        assert done.returncode == 0, done.output[-4000:]
        assert done.results()["world_size"] == 2 and done.results()["global_batch"] == 16
    assert graph.results()["timed_phase"] == "graph"
    why = f"eager {train_losses(eager)}\ngraph {train_losses(graph)}"
    assert [s for s, _ in train_losses(eager)] == [s for s, _ in train_losses(graph)], why
    for (step, le), (_, lg) in zip(train_losses(eager), train_losses(graph)):
        assert math.isfinite(le) and lg == pytest.approx(le, rel=REL_TOLERANCE), f"train loss at step {step}\n{why}"


# Sharded in bf16, the graph and eager steps agree as tests/test_fsdp_gpu.py's bf16 cases do.
FSDP2_REL_TOLERANCE = 2e-2


def test_a_meta_device_build_sharded_with_fsdp2_trains_graphed_and_compiled_like_eager(out):
    """train.fsdp.init=meta: the llama built on the meta device, sharded (2 GPUs where there are two),
    drawn by transformers' initialization on the GPU; graph=full and graph=full_compiled (each decoder layer
    compiled, the mask and rotary tables built eagerly between them) follow eager from the same draws."""
    args = [*SAME_RUNS, *model("llama"), "train.parallel=fsdp2", "train.fsdp.init=meta", "recipe.data.batch_size=8"]
    nproc = 2 if cuda_count() >= 2 else None
    eager = launch([*args, "graph=eager"], out / "eager", nproc=nproc, timeout=600)
    for graph in ("full", "full_compiled"):
        done = launch([*args, f"graph={graph}"], out / graph, nproc=nproc, timeout=600)
        for run in (eager, done):
            assert run.returncode == 0, run.output[-4000:]
        assert done.results()["timed_phase"] == "graph"
        why = f"eager {train_losses(eager)}\n{graph} {train_losses(done)}"
        first = train_losses(eager)[0][1]
        assert abs(first - math.log(256)) < 0.5, why  # drawn small, as from_config draws them: about chance
        assert [s for s, _ in train_losses(eager)] == [s for s, _ in train_losses(done)], why
        for (step, le), (_, lg) in zip(train_losses(eager), train_losses(done)):
            assert math.isfinite(le) and lg == pytest.approx(le, rel=FSDP2_REL_TOLERANCE), f"loss at step {step}\n{why}"
        losses = [loss for _, loss in train_losses(done)]
        assert losses[-1] < losses[0] - 0.5, f"no training progress: {why}"


def test_a_captured_forward_builds_no_attention_mask():
    """While a stream captures, transformers builds the whole causal mask for its own "sdpa" attention (it
    never takes SDPA's is_causal shortcut then); the recipe's attention builds none, so a captured step runs
    the flash kernel an eager step runs. Both asked inside one real capture."""
    import torch

    from recipes.hf_causal_lm import CAUSAL_SDPA
    from test_hf_causal_lm import built_model, causal_mask_built

    ours = built_model(MODELS["llama"]).cuda()
    assert ours.config._attn_implementation == CAUSAL_SDPA
    embeds = torch.zeros(2, 64, MODELS["llama"]["hidden_size"], device="cuda")
    stock = built_model(MODELS["llama"]).cuda()
    stock.set_attn_implementation("sdpa")
    masks = {}
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        masks["recipe"] = causal_mask_built(ours, embeds)
        masks["stock"] = causal_mask_built(stock, embeds)
    assert masks["recipe"] is None
    assert isinstance(masks["stock"], torch.Tensor) and masks["stock"].shape[-2:] == (64, 64)  # what it replaces


# The head in chunks (recipes/chunked_head.py) sums a chunk's weight gradient in fp32 where the whole logits' is one
# bf16 product: eager against eager, bf16 rounding of that gradient, amplified by training. Compiled and graphed,
# Inductor's fusions too, as COMPILED_TOLERANCE in tests/test_recipes_gpu.py.
CHUNKED_TOLERANCE = {"eager": 2e-3, "full": 2e-3, "full_compiled": 2e-2}


@pytest.mark.parametrize("graph,bound,against", [("full", 128, "whole"), ("full_compiled", 128, "whole"),
                                                  ("full", 80, "eager")])
def test_the_head_at_the_loss_tokens_only_trains_like_eager(out, tmp_path, graph, bound, against):
    """recipe.model.head_loss_tokens_per_row on prompt/completion pairs (about half the tokens carry loss), qwen2,
    16 rows of 128 tokens, the head in chunks of 500. At 128 (the packing is the unbounded one) captured whole and
    compiled inside the graph against the whole logits eager; at 80 (a binding bound: unbounded, rows hold up to
    110; the rows differ) captured against the same bound eager: the loss positions' gather, whose count changes every step, replays right."""
    from helpers.documents import pairs_directory

    data = [f"recipe.data.root={pairs_directory(tmp_path, n=3000)}", "recipe.data.source=tokens",
            "recipe.data.train_size=null", "recipe.data.test_size=null"]
    args = [*SAME_RUNS, *model("qwen2"), *data]
    head = ["recipe.model.head_chunk_tokens=500", f"recipe.model.head_loss_tokens_per_row={bound}"]
    reference = launch([*args, "graph=eager", *(head if against == "eager" else [])], out / "reference", timeout=600)
    done = launch([*args, f"graph={graph}", *head], out / graph, timeout=600)
    for run in (reference, done):
        assert run.returncode == 0, run.output[-4000:]
    tolerance = REL_TOLERANCE if against == "eager" else CHUNKED_TOLERANCE[graph]
    why = f"reference {train_losses(reference)}\n{graph}, bound {bound}: {train_losses(done)}"
    assert [s for s, _ in train_losses(reference)] == [s for s, _ in train_losses(done)], why
    for (step, lr), (_, lg) in zip(train_losses(reference), train_losses(done)):
        assert math.isfinite(lr) and lg == pytest.approx(lr, rel=tolerance), f"step {step}\n{why}"
    assert done.results()["final/eval_loss"] == pytest.approx(reference.results()["final/eval_loss"], rel=tolerance)
    assert done.results()["data/loss_tokens"] < 0.7 * done.results()["data/real_tokens"]


@pytest.mark.parametrize("graph,parallel", [*((g, "ddp") for g in sorted(CHUNKED_TOLERANCE)), ("full", "fsdp2")])
def test_the_head_in_chunks_trains_like_the_whole_logits_eager(out, graph, parallel):
    """recipe.model.head_chunk_tokens: qwen2's (untied) head, 16 x 128 tokens in chunks of 500, eager, captured whole
    and compiled inside the graph, against the whole logits eager; under FSDP2 (one rank, the root kept gathered
    for the loss) too."""
    sharded = ["train.parallel=fsdp2", "train.fsdp.root=gathered"] if parallel == "fsdp2" else []
    args = [*SAME_RUNS, *model("qwen2"), *sharded]
    whole = launch([*args, "graph=eager"], out / "whole", timeout=600)
    chunked = launch([*args, f"graph={graph}", "recipe.model.head_chunk_tokens=500"], out / graph, timeout=600)
    for done in (whole, chunked):
        assert done.returncode == 0, done.output[-4000:]
    why = f"whole logits {train_losses(whole)}\nchunked, {graph} {train_losses(chunked)}"
    assert [s for s, _ in train_losses(whole)] == [s for s, _ in train_losses(chunked)], why
    for (step, lw), (_, lc) in zip(train_losses(whole), train_losses(chunked)):
        assert math.isfinite(lw) and lc == pytest.approx(lw, rel=CHUNKED_TOLERANCE[graph]), f"step {step}\n{why}"
    w, c = whole.results(), chunked.results()
    assert c["final/eval_loss"] == pytest.approx(w["final/eval_loss"], rel=CHUNKED_TOLERANCE[graph]), why
    assert c["final/eval_accuracy"] == pytest.approx(w["final/eval_accuracy"], abs=0.01), why
