"""Attention within packed documents: each kernel's forward + backward, eager and CUDA-graphed, on one GPU.

    python scripts/bench_document_attention.py                      # the shapes below, both length spreads
    python scripts/bench_document_attention.py --shapes mha --iters 50

For each shape (rows of T tokens; query heads, key/value heads, head size) and each spread of document
lengths, it packs random documents into rows (document_ids and cu_seqlens as trainer/data/packing.py
writes them) and times, in bf16:
- ``causal``: SDPA ``is_causal`` over the whole row (what attention across documents costs);
- ``flex``, ``varlen``, ``dense``: recipes/document_attention.py's kernels, each with its mask built from the
  row's boundaries inside the timed work (once per forward, as the models do).
Eager: each iteration builds the mask and runs forward and backward. Graphed: the same captured in one CUDA
graph, new boundaries copied into its static inputs before each replay. Both are timed over one window of
``--iters`` iterations (CUDA events at its ends). Each document kernel is also checked: its output against the
fp32 dense reference, and a graph replayed with another batch's boundaries against eager on that batch.
Rows go to --output (JSON) and a Markdown table beside it, with commit, versions and GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.lib.timing import time_window  # noqa: E402

# name: (rows, tokens per row, query heads, key/value heads, head size)
SHAPES = {
    "mha": (1, 8192, 16, 16, 128),  # the measurement: 8192 tokens, 16 heads of 128
    "qwen2_0.5b": (4, 4096, 14, 2, 64),  # Qwen2-0.5B's attention, GQA 7:1
    "llama3_1b": (2, 4096, 32, 8, 64),  # Llama-3.2-1B's attention, GQA 4:1
}
SPREADS = {"lognormal300": "lognormal around 300 tokens, 16 to 4096", "uniform64_2048": "uniform 64 to 2048 tokens"}
KERNELS = ("causal", "flex", "varlen", "dense")


def document_lengths(rng, spread: str, n: int):
    import numpy as np

    if spread == "lognormal300":
        return np.clip(rng.lognormal(np.log(300), 0.8, n), 16, 4096).astype(np.int64)
    return rng.integers(64, 2049, n)


def packed_row_lengths(rng, spread: str, context: int):
    """The lengths of the documents filling one row (the last cut to fit, as a long document's piece would be)."""
    lengths, at = [], 0
    while at < context:
        n = int(min(document_lengths(rng, spread, 1)[0], context - at))
        lengths.append(n)
        at += n
    return lengths


def packed_boundaries(rows_lengths, context: int, max_documents: int):
    """document_ids [rows, context] and cu_seqlens [rows, max_documents + 2] of rows holding documents of these
    lengths, int32, as PackedDocuments gives them (``max_documents``: the most a row of the whole run holds)."""
    import numpy as np
    import torch

    ids = np.zeros((len(rows_lengths), context), np.int32)
    cu = np.full((len(rows_lengths), max_documents + 2), context, np.int32)
    cu[:, 0] = 0
    for r, lengths in enumerate(rows_lengths):
        ends = np.cumsum(lengths)
        cu[r, 1:len(lengths) + 1] = ends
        for k, (start, end) in enumerate(zip(ends - lengths, ends)):
            ids[r, start:end] = k
    return torch.from_numpy(ids), torch.from_numpy(cu)


def step_fn(kernel: str, q, k, v, grad):
    """Forward and backward of one kernel over static q, k, v [B, T, H, D]; the mask built from ``boundaries``."""
    import torch
    import torch.nn.functional as F

    from recipes.document_attention import DocumentMask

    def run(document_ids, cu_seqlens):
        for t in (q, k, v):
            t.grad = None
        if kernel == "causal":
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
        else:
            out = DocumentMask.build(document_ids, cu_seqlens, kernel).attend(q, k, v)
        out.backward(grad)
        return out

    return run


def measure(shape: str, spread: str, kernel: str, iters: int, seed: int) -> Dict:
    import numpy as np
    import torch

    rows, context, hq, hkv, d = SHAPES[shape]
    rng = np.random.default_rng(seed)
    # cu_seqlens sized as PackedDocuments sizes it: the most documents any row of the packing holds (here: of 64
    # rows drawn alike). varlen's grid grows with it (every slot a sequence, empty or not); flex reads document_ids.
    drawn = [packed_row_lengths(rng, spread, context) for _ in range(max(64, 4 * rows))]
    max_documents = max(len(lengths) for lengths in drawn)
    batches = [packed_boundaries(drawn[b * rows:(b + 1) * rows], context, max_documents) for b in range(4)]
    batches = [(i.cuda(), c.cuda()) for i, c in batches]
    torch.manual_seed(seed)
    q = torch.randn(rows, context, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(rows, context, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(rows, context, hq, d, device="cuda", dtype=torch.bfloat16)
    run = step_fn(kernel, q, k, v, grad)
    row = {"shape": shape, "rows": rows, "max_documents": max_documents, "tokens_per_row": context, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
           "spread": spread, "kernel": kernel,
           "documents_per_row": round(float(np.mean([len(lengths) for lengths in drawn[:4 * rows]])), 1)}
    if kernel not in ("causal",):
        ref_ids, ref_cu = batches[0]
        with torch.no_grad():
            from recipes.document_attention import DocumentMask

            expect = DocumentMask.build(ref_ids, ref_cu, "dense").attend(q.float(), k.float(), v.float())
            got = DocumentMask.build(ref_ids, ref_cu, kernel).attend(q, k, v)
        row["max_abs_diff_vs_fp32_dense"] = float((got.float() - expect).abs().max())
    cycle = iter(range(10 ** 9))

    def eager():
        ids, cu = batches[next(cycle) % len(batches)]
        run(ids, cu)

    for _ in range(3):
        eager()  # compiles flex's kernels and mask builder
    row["eager_ms"] = round(time_window(eager, iters), 3)

    static_ids, static_cu = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run(static_ids, static_cu)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run(static_ids, static_cu)

    def replay():
        ids, cu = batches[next(cycle) % len(batches)]
        static_ids.copy_(ids)
        static_cu.copy_(cu)
        graph.replay()

    row["graphed_ms"] = round(time_window(replay, iters), 3)
    # a replay with another batch's boundaries computes what eager computes on that batch
    static_ids.copy_(batches[1][0])
    static_cu.copy_(batches[1][1])
    graph.replay()
    replayed = static_out.detach().clone()
    torch.cuda.synchronize()
    eager_out = run(*batches[1]).detach()
    row["replay_equals_eager"] = bool(torch.equal(replayed, eager_out))
    return row


def markdown(rows: List[Dict], measured: Dict) -> str:
    from scripts.lib.comparison import provenance_line

    lines = ["| shape | spread | docs/row | kernel | eager ms | graphed ms | vs causal (graphed) | max abs diff | replay = eager |",
             "|---|---|---:|---|---:|---:|---:|---:|---|"]
    causal = {(r["shape"], r["spread"]): r.get("graphed_ms") for r in rows if r["kernel"] == "causal"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['spread']} | | {r['kernel']} | failed: {r['error'][:80]} | | | | |")
            continue
        base = causal.get((r["shape"], r["spread"]))
        ratio = f"{r['graphed_ms'] / base:.2f}x" if base else ""
        diff = f"{r['max_abs_diff_vs_fp32_dense']:.4f}" if "max_abs_diff_vs_fp32_dense" in r else ""
        lines.append(f"| {r['shape']} ({r['rows']}x{r['tokens_per_row']}, {r['q_heads']}/{r['kv_heads']} heads of "
                     f"{r['head_dim']}) | {r['spread']} | {r['documents_per_row']} | {r['kernel']} | {r['eager_ms']} | "
                     f"{r['graphed_ms']} | {ratio} | {diff} | {r['replay_equals_eager']} |")
    return "\n".join(lines) + "\n\n" + provenance_line(measured) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--spreads", nargs="+", default=list(SPREADS), choices=list(SPREADS))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=ROOT / "scripts/results/document_attention.json")
    args = parser.parse_args(argv)
    import torch

    from scripts.lib.comparison import provenance

    if not torch.cuda.is_available():
        print("bench_document_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    measured = provenance(torch.cuda.get_device_name())
    rows = []
    for shape in args.shapes:
        for spread in args.spreads:
            for kernel in args.kernels:
                try:
                    row = measure(shape, spread, kernel, args.iters, args.seed)
                except Exception as e:  # a kernel that cannot run this shape: its row says why, the others stay
                    row = {"shape": shape, "spread": spread, "kernel": kernel, "error": f"{type(e).__name__}: {e}"}
                torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
                rows.append({**row, "provenance": measured})
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"rows": rows, "command": sys.argv}, indent=1) + "\n")
    args.output.with_suffix(".md").write_text(markdown(rows, measured))
    print(markdown(rows, measured))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
