"""Attention within packed documents, and the models that read packed rows, on the CPU.

The claim a packed step has to meet: its loss (the summed token losses over the step's loss tokens) and its
gradients are those of the same documents run one at a time, each from position 0 (fp64, 1e-6 and tighter);
changing one document changes no other's outputs. The kernels (recipes/document_attention.py) are checked
against SDPA on each document alone; the CUDA kernels against the same on the GPU (test_document_attention_gpu).
"""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.availability import needs_extra
from helpers.documents import document_directory
from helpers.launches import launch

from recipes.document_attention import DocumentMask, dense_document_mask
from trainer.data.packing import Documents, PackedDocuments, cu_seqlens_from_document_ids
from trainer.recipe import IGNORE_INDEX


def packed_rows(lengths_per_row, context):
    """document_ids and cu_seqlens of rows holding documents of these lengths (padding after)."""
    ids = torch.full((len(lengths_per_row), context), -1, dtype=torch.int32)
    for r, lengths in enumerate(lengths_per_row):
        at = 0
        for k, n in enumerate(lengths):
            ids[r, at:at + n] = k
            at += n
    return ids, cu_seqlens_from_document_ids(ids, max(len(x) for x in lengths_per_row) + 2)


def spans(document_ids, row):
    """(document, start, end) of each document (not padding) in ``row``."""
    ids = document_ids[row].tolist()
    out = []
    for k in sorted(set(ids) - {-1}):
        where = [i for i, d in enumerate(ids) if d == k]
        out.append((k, where[0], where[-1] + 1))
    return out


@pytest.mark.fast
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa-2", "mqa"])
def test_the_dense_reference_is_each_document_attended_alone(heads):
    hq, hkv = heads
    ids, cu = packed_rows([[5, 1, 7, 3], [16], [2, 9]], 16)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 16, hq, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(3, 16, hkv, 8, dtype=torch.float64, generator=g) for _ in range(2))
    out = DocumentMask.build(ids, cu, "dense").attend(q, k, v)
    for row in range(3):
        for _, a, b in spans(ids, row):
            alone = F.scaled_dot_product_attention(*(t[row:row + 1, a:b].transpose(1, 2) for t in (q, k, v)),
                                                   is_causal=True, enable_gqa=hq != hkv).transpose(1, 2)
            torch.testing.assert_close(out[row:row + 1, a:b], alone, rtol=0, atol=1e-12)


@pytest.mark.fast
def test_the_dense_mask_keeps_padding_to_itself_so_no_query_sees_nothing():
    ids, _ = packed_rows([[3, 2]], 8)
    mask = dense_document_mask(ids)[0]
    assert mask.any(dim=1).all()  # every query attends to at least itself
    assert not mask[:5, 5:].any() and not mask[5:, :5].any()  # documents never see padding, nor padding them
    assert not mask[3:5, :3].any()  # the second document never sees the first


def test_flex_attention_equals_the_dense_reference():
    """FlexAttention compiled on the CPU (Inductor's CPU template): the same kernel code path as on CUDA, its block
    mask built from document_ids by the same compiled function."""
    ids, cu = packed_rows([[40, 30, 58], [128], [1, 100]], 128)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 128, 4, 16, generator=g)
    k, v = (torch.randn(3, 128, 2, 16, generator=g) for _ in range(2))
    flex = DocumentMask.build(ids, cu, "flex").attend(q, k, v)
    dense = DocumentMask.build(ids, cu, "dense").attend(q, k, v)
    real = ids >= 0
    torch.testing.assert_close(flex[real], dense[real], rtol=1e-5, atol=1e-5)


def test_inside_a_compiled_model_the_block_mask_is_built_outside_its_graph(monkeypatch):
    """graph.compile_model traces the model with its DocumentMask.build: the flex block mask must still be built by
    its own compiled function, not traced into the model's graph (on an H200, Inductor fused the traced mask into
    evaluation's attention kernel and the kernel faulted). The result is the dense reference's. Without gradients,
    as in evaluation: FlexAttention has no backward on the CPU."""
    import recipes.document_attention as document_attention

    builder = document_attention._compiled_block_mask_builder()
    tracing = []

    def recording_builder(document_ids):
        tracing.append(torch.compiler.is_compiling())
        return builder(document_ids)

    monkeypatch.setattr(document_attention, "_compiled_block_mask_builder", lambda: recording_builder)
    ids, cu = packed_rows([[40, 30, 58], [128]], 128)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 128, 4, 16, generator=g)
    k, v = (torch.randn(2, 128, 2, 16, generator=g) for _ in range(2))

    def model(q, k, v, ids, cu):
        return DocumentMask.build(ids, cu, "flex").attend(q * 2, k, v).sum(-1)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = torch.compile(model, dynamic=False)(q, k, v, ids, cu)
    assert tracing and not any(tracing), tracing  # called, and each time outside Dynamo's trace
    # the attention is traced as plain flex_attention, not through the process's lru_cache'd compiled one
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]
    dense = DocumentMask.build(ids, cu, "dense").attend(q * 2, k, v).sum(-1)
    real = ids >= 0
    torch.testing.assert_close(out[real], dense[real], rtol=1e-5, atol=1e-5)


@pytest.mark.fast
def test_wide_inputs_are_cast_to_the_autocast_dtype_as_sdpa_takes_them():
    from recipes.document_attention import autocast_inputs

    q, ids = torch.randn(2, 8, 4, 16), torch.arange(8, dtype=torch.int32)
    assert [t.dtype for t in autocast_inputs(q, ids)] == [torch.float32, torch.int32]  # autocast off: as given
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = autocast_inputs(q, q.double(), q.half(), ids)
    assert [t.dtype for t in cast] == [torch.bfloat16, torch.bfloat16, torch.float16, torch.int32]
    assert torch.equal(cast[0], q.to(torch.bfloat16))


@pytest.mark.fast
def test_flex_backward_tiles_are_asked_for_on_cuda_in_half_precision_only():
    """The tiles are a CUDA kernel's; on the CPU and in fp32 flex keeps its own choice. Each entry names the
    backward kernel's options alone (the bwd_ prefix), so the forward keeps Inductor's."""
    from recipes.document_attention import FLEX_BACKWARD_TILES, flex_kernel_options

    assert flex_kernel_options(torch.ones(1, 2, 8, 64, dtype=torch.bfloat16)) is None
    assert flex_kernel_options(torch.ones(1, 2, 8, 64)) is None
    for (capability, head_dim), options in FLEX_BACKWARD_TILES.items():
        assert len(capability) == 2 and head_dim in (16, 32, 64, 128, 256), capability
        assert options and all(key.startswith("bwd_") for key in options), options


def test_an_unknown_kernel_is_named():
    ids, cu = packed_rows([[4]], 4)
    with pytest.raises(ValueError, match="'flash' is not one of auto, dense, flex, varlen"):
        DocumentMask.build(ids, cu, "flash")


# ---- the models: a packed step equals its documents one at a time ----------------------------------------

class ListDocuments(Documents):
    def __init__(self, docs, targets=None):
        lengths = [len(d) for d in docs]
        super().__init__(np.concatenate(docs).astype(np.int64), np.concatenate([[0], np.cumsum(lengths)]),
                         None if targets is None else np.concatenate(targets).astype(np.uint8), "test documents")


def random_documents(seed, vocab, lengths, with_targets=False):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, n) for n in lengths]
    targets = [rng.integers(0, 2, n) for n in lengths] if with_targets else None
    return docs, targets


def packed_batch(docs, targets, context):
    data = PackedDocuments(ListDocuments(docs, targets), context, x_dtype=np.int64)
    items = [data[i] for i in range(len(data))]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def summed_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def one_at_a_time(model_logits, docs, targets):
    """The documents' summed token losses run each alone (positions from 0), and their loss-token count."""
    total, count = 0.0, 0
    for d, doc in enumerate(docs):
        x = torch.as_tensor(doc[:-1])[None]
        y = torch.as_tensor(doc[1:]).clone()
        if targets is not None:
            y[torch.as_tensor(targets[d][1:]) == 0] = IGNORE_INDEX
        total = total + summed_loss(model_logits(x, None), y[None])
        count += int((y != IGNORE_INDEX).sum())
    return total, count


def check_packed_equals_alone(model, packed_logits, alone_logits, docs, targets, context):
    batch = packed_batch(docs, targets, context)
    params = [p for p in model.parameters() if p.requires_grad]
    count = int((batch["y"] != IGNORE_INDEX).sum())
    packed = summed_loss(packed_logits(batch), batch["y"]) / count
    grads_packed = torch.autograd.grad(packed, params)
    total, count_alone = one_at_a_time(alone_logits, docs, targets)
    assert count_alone == count
    alone = total / count_alone
    grads_alone = torch.autograd.grad(alone, params)
    assert abs(packed.item() - alone.item()) < 1e-9
    for a, b in zip(grads_packed, grads_alone):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def tiny_gpt(context=48, attention_kernel="dense"):
    from recipes.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, d_model=32, context=context, vocab=64),
               attention_kernel=attention_kernel).double()


@pytest.mark.fast
@pytest.mark.parametrize("with_targets", [False, True], ids=["every-token", "loss-mask"])
def test_a_packed_gpt_step_equals_its_documents_one_at_a_time(with_targets):
    from recipes.gpt import document_forward

    docs, targets = random_documents(0, 64, [7, 30, 2, 19, 25, 11, 40], with_targets)
    model = tiny_gpt()
    check_packed_equals_alone(model, lambda batch: document_forward(model, batch),
                              lambda x, _: model(x), docs, targets, context=48)


@pytest.mark.fast
def test_changing_one_document_changes_no_other_documents_outputs():
    from recipes.gpt import document_forward

    docs, _ = random_documents(1, 64, [10, 12, 9, 14], False)
    model = tiny_gpt()
    batch = packed_batch(docs, None, 48)
    assert batch["x"].shape[0] == 1  # all four share the row
    before = document_forward(model, batch)
    changed = dict(batch)
    changed["x"] = batch["x"].clone()
    second = batch["document_ids"][0] == 1
    changed["x"][0, second] = (changed["x"][0, second] + 1) % 64
    after = document_forward(model, changed)
    others = (batch["document_ids"][0] != 1) & (batch["document_ids"][0] >= 0)
    assert torch.equal(before[0, others], after[0, others])
    assert not torch.equal(before[0, second], after[0, second])


def hf_model(model_type):
    transformers = needs_extra("transformers")
    from recipes.hf_documents import use_document_attention

    kwargs = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64,
                  max_position_embeddings=64, num_key_value_heads=2)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    model.config.use_cache = False
    use_document_attention(model, transformers, plain_causal=True)
    return model


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_packed_transformers_step_equals_its_documents_one_at_a_time(model_type):
    """Grouped-query models (2 key/value heads for 4 query heads), RoPE at each document's own positions."""
    from recipes.hf_documents import document_logits

    model = hf_model(model_type)
    docs, targets = random_documents(2, 64, [7, 30, 2, 19, 25, 11, 40], True)
    alone = model_type  # run alone through transformers' own causal attention: the reference is not ours

    def reference(x, _):
        model.set_attn_implementation("sdpa")
        try:
            return model(x).logits
        finally:
            model.set_attn_implementation("document_attention")

    check_packed_equals_alone(model, lambda batch: document_logits(model, batch), reference, docs, targets,
                              context=48)
    assert alone


def test_a_model_whose_attention_is_more_than_causal_is_refused_naming_the_setting():
    transformers = needs_extra("transformers")
    from recipes.hf_documents import use_document_attention
    from trainer.run.errors import ConfigError

    config = transformers.AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=r"attn_pdrop=0.1.*recipe.data.attention=causal"):
        use_document_attention(model, transformers, plain_causal=True)
    with pytest.raises(ConfigError, match="more than causal"):
        use_document_attention(model, transformers, plain_causal=False)


# ---- train.py on documents ------------------------------------------------------------------------------------

TINY = ["recipe=gpt_tiny", "recipe.model.n_layer=1", "recipe.model.n_head=2", "recipe.model.d_model=32",
        "recipe.model.context=64", "recipe.data.batch_size=4", "recipe.data.eval_batch_size=8", "logger=none",
        "train.progress=false", "train.max_steps=12", "train.log_every=4", "recipe.data.source=tokens"]


def test_gpt_tiny_trains_on_documents_reports_padding_and_counts_loss_tokens(tmp_path):
    root = document_directory(tmp_path)
    done = launch([*TINY, f"recipe.data.root={root}"], tmp_path / "runs")
    assert done.returncode == 0, done.output[-3000:]
    assert "packed into" in done.output and "padding" in done.output
    results = done.results()
    meta = json.loads((root / "meta.json").read_text())
    # the test split's loss tokens: every token but each document's last
    assert results["final/eval_tokens"] == meta["tokens"]["val.bin"] - meta["documents"]["val.bin"]
    assert np.isfinite(results["final/loss"])
    assert results["data/documents"] == meta["documents"]["train.bin"]
    assert results["data/real_tokens"] == meta["tokens"]["train.bin"]
    assert 0 < results["data/padding_fraction"] < 0.1
    padding = 1 - results["data/real_tokens"] / (results["data/rows"] * 64)
    assert results["data/padding_fraction"] == pytest.approx(padding)
    assert results["perf/real_tokens_per_s"] == pytest.approx(results["perf/tokens_per_s"] * (1 - padding))


@pytest.mark.fast
@pytest.mark.parametrize("overrides,message", [
    (["recipe.data.attention=document"], "recipe.data.attention=document needs document boundaries"),
    (["recipe.data.attention=sideways"], "recipe.data.attention='sideways' is not one of auto, document, causal"),
    (["recipe.data.attention_kernel=flex"], "recipe.data.attention_kernel=flex is the kernel of attention within"),
    (["recipe.data.split_long_documents=false"], "recipe.data.split_long_documents=false is read for data with"),
])
def test_document_settings_on_a_stream_are_refused_naming_the_setting(overrides, message):
    from recipes.gpt import attention_mode
    from trainer.run.errors import ConfigError
    from conf.schema import DataConfig
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.from_dotlist(
        [o.removeprefix("recipe.data.") for o in overrides]))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        attention_mode(cfg, packed=False)


@pytest.mark.parametrize("overrides,message", [
    (["recipe.data.attention_kernel=varlen"], "recipe.data.attention_kernel=varlen trains on CUDA GPUs only"),
    (["recipe.data.attention_kernel=flex"], "recipe.data.attention_kernel=flex trains on CUDA GPUs only"),
    (["recipe.data.attention=causal", "recipe.data.attention_kernel=dense"],
     "recipe.data.attention_kernel=dense is the kernel of attention within documents, and this run attends "
     "causally (recipe.data.attention=causal)"),
    (["recipe.model.dropout=0.1"], "recipe.model.dropout=0.1: attention within documents has no dropout"),
    (["recipe.data.seq_len_buckets=[32]"], "recipe.data.seq_len_buckets cuts rows short"),
    (["recipe.data.split_long_documents=false", "recipe.model.context=16"],
     "set recipe.data.split_long_documents=true to cut them into pieces, or a larger recipe.model.context"),
])
def test_bad_document_settings_stop_the_run_naming_the_setting(train_here, tmp_path, overrides, message):
    root = document_directory(tmp_path)
    done = train_here([*TINY, f"recipe.data.root={root}", *overrides])
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr


def test_two_gloo_ranks_on_documents_resume_mid_epoch_exactly_as_if_never_stopped(tmp_path):
    """Each rank packs the same rows and takes its share; a run stopped at step 4 of an epoch of about 24 and
    resumed ends with the weights of the run that never stopped (the same rows in the same order, the same
    loss-token counts across ranks)."""
    from helpers.launches import launch_together

    root = document_directory(tmp_path)
    args = [*TINY, f"recipe.data.root={root}", "train.precision=fp32", "recipe.data.attention=document"]
    runs = launch_together({"straight": [*args, "train.max_steps=8"], "stopped": [*args, "train.max_steps=4"]},
                           tmp_path / "runs", nproc=2, timeout=300)
    for done in runs.values():
        assert done.returncode == 0, done.output[-3000:]
    straight, stopped = runs["straight"], runs["stopped"]
    assert stopped.results()["data/rows"] // 8 > 8  # the epoch is longer than the run: step 4 is mid-epoch
    run_dir = stopped.run_dir
    resumed = launch([*args, "train.max_steps=8", f"run_dir={run_dir}"], tmp_path / "runs" / "stopped", nproc=2,
                     timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "resumed from" in resumed.output and "at step 4" in resumed.output
    assert resumed.results()["steps"] == 8
    assert resumed.results()["param_digests"] == straight.results()["param_digests"]
    losses = {name: [m["train/loss"] for m in done.metrics() if "train/loss" in m]
              for name, done in (("straight", straight), ("resumed", resumed))}
    assert losses["resumed"] == losses["straight"], losses


def test_a_tiny_llama_fine_tunes_on_conversations_with_loss_on_the_replies_only(tmp_path, train_here):
    """What docs/hf_models.md shows, end to end on the CPU: a tokenizer directory with a chat template and a
    save_pretrained model (both made here), prepare_text.py --input chat, train.py recipe=hf_causal_lm on the
    token files. Every label that counts is a reply's token: the loss tokens the run counts are the loss mask's."""
    transformers = needs_extra("transformers")
    from test_documents import CONVERSATION, tokenizer_directory, write_jsonl

    from scripts.prepare_text import main as prepare

    tokenizer = tokenizer_directory(tmp_path / "tokenizer")
    chats = [CONVERSATION, CONVERSATION[1:3], CONVERSATION[:3], CONVERSATION[1:]] * 10
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in chats])
    prepare([str(source), "--input", "chat", "--tokenizer", str(tokenizer), "--output", str(tmp_path / "tokens"),
             "--val-fraction", "0.2"])
    config = transformers.AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                               max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")

    done = train_here(["recipe=hf_causal_lm", "recipe.model.config=null", f"recipe.model.path={tmp_path / 'model'}",
                       "recipe.model.context=128", "recipe.data.source=tokens",
                       f"recipe.data.root={tmp_path / 'tokens'}", "recipe.data.batch_size=2",
                       "recipe.data.eval_batch_size=4", "logger=none", "train.max_steps=6", "train.log_every=2",
                       "train.precision=fp32"])
    assert done.returncode == 0, done.stderr[-3000:]
    results = done.results()
    loss_mask = np.fromfile(tmp_path / "tokens" / "val.loss.bin", dtype=np.uint8)
    offsets = np.load(tmp_path / "tokens" / "val.docs.npy")
    first_tokens = loss_mask[offsets[:-1]].sum()  # a document's first token is no document's label
    assert results["final/eval_tokens"] == loss_mask.sum() - first_tokens
    assert results["data/loss_tokens"] < results["data/real_tokens"] / 2  # the prompts carry none
    assert np.isfinite(results["final/eval_loss"])


def test_a_window_whose_labels_are_all_prompt_logs_no_loss_and_trains_on(tmp_path):
    """Long prompts with short completions, cut into rows of 64: most rows hold prompt tokens only. A log window
    of such rows has no loss term to average over; it logs no loss (not a division by zero) and the run goes on."""
    from test_documents import prepare, write_jsonl

    pairs = [{"prompt": f"Q{i}: " + "what is it? " * 7, "completion": f" {i}"} for i in range(40)]
    prepare(write_jsonl(tmp_path / "pairs.jsonl", pairs), "--input", "pairs", "--output", tmp_path / "tokens",
            "--val-fraction", "0.2")
    done = launch([*TINY, f"recipe.data.root={tmp_path / 'tokens'}", "recipe.data.batch_size=1",
                   "train.log_every=1", "train.max_steps=12"], tmp_path / "runs")
    assert done.returncode == 0, done.output[-3000:]
    windows = [m for m in done.metrics() if "train/lr" in m]
    assert len(windows) == 12
    silent = [m["step"] for m in windows if "train/loss" not in m]
    counted = [m["train/loss"] for m in windows if "train/loss" in m]
    assert silent and counted, windows  # both kinds of window, in one run
    assert all(np.isfinite(counted)) and np.isfinite(done.results()["final/eval_loss"])
