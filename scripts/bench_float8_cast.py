"""The weight cast before FSDP2's float8 all-gather, alone: how long each way of writing it takes to compile
and to run, on one GPU, for one rank's shards of a Llama 3 shape (trainer/parallel/float8_cast.py).

    python scripts/bench_float8_cast.py                      # Llama 1b's shards on 2 ranks
    python scripts/bench_float8_cast.py --size 8b --ranks 8

Ways (each in a process of its own, started by scripts/lib/launch.py as every benchmark's runs are, with empty
compile caches, so that its first call pays the whole compile):
``list_static``: one function over every shard, compiled for their shapes (what the trainer runs);
``list_dynamic``: the same compiled for any shapes; ``one_dynamic``: one shard at a time, flattened, one
compiled kernel for any length; ``eager``: torchao's three kernels a shard (scale, clamp, cast), once.
Per way: the first call (compile included), a call launched from Python, a call replayed in a CUDA graph
(what a graphed step pays), and whether its bytes are eager's. Prints a Markdown table; writes it and the
numbers to --output (default scripts/results/float8_cast_<size>_<ranks>ranks.json and .md), with the commit,
versions and GPU they were measured with. A way whose process fails or runs past --timeout (its processes all
ended) is marked in its row, the others kept, and the script exits 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.lib.comparison import (  # noqa: E402
    exit_status, provenance, provenance_line, with_provenance,
)
from scripts.lib.launch import gpu_name, run_or_mark  # noqa: E402
from scripts.lib.llama3 import SHAPES  # noqa: E402
from scripts.lib.refuse import refuse  # noqa: E402
from scripts.lib.timing import time_window  # noqa: E402

ITERS = 20  # calls in each timed window

WAYS = ("list_static", "list_dynamic", "one_dynamic", "eager")


def measure(way: str, size: str, ranks: int) -> dict:
    """In this process: ``way``'s timings over one rank's shards of ``size``."""
    import time

    import torch

    from trainer.parallel.float8_cast import cast_shards

    shape = SHAPES[size]
    dim, ffn, kv = shape.dim, shape.ffn_hidden, shape.head_dim * shape.kv_heads
    per_block = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn)]
    shards = [torch.randn(rows // ranks, cols, device="cuda") * 0.02
              for rows, cols in per_block * shape.layers]
    f8 = torch.float8_e4m3fn
    scales = [(torch.finfo(f8).max / w.abs().amax()).float() for w in shards]
    if way == "one_dynamic":
        one = torch.compile(lambda w, s, d: cast_shards([w], [s], d)[0], dynamic=True)
        call = lambda: [one(w.reshape(-1), s, f8).view(w.shape) for w, s in zip(shards, scales)]  # noqa: E731
    else:
        cast = cast_shards if way == "eager" else torch.compile(cast_shards, dynamic=way == "list_dynamic")
        call = lambda: cast(shards, scales, f8)  # noqa: E731
    torch.cuda.synchronize()
    began = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    first = time.perf_counter() - began

    for _ in range(3):
        call()
    launched = time_window(call, ITERS)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graphed = time_window(graph.replay, ITERS)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cast_shards(shards, scales, f8), out))
    return {"way": way, "first_call_s": first, "launched_ms": launched, "graphed_ms": graphed, "bytes_as_eager": same,
            "shards": len(shards), "elements": sum(w.numel() for w in shards)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1b", help="a Llama 3 shape of scripts/lib/llama3.py (1b, 8b, ...)")
    parser.add_argument("--ranks", type=int, default=2, help="FSDP2 ranks the weights are sharded over")
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of: " + ", ".join(WAYS))
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a way's process may take")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: measure this way
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)  # where the child writes it
    args = parser.parse_args()
    if args.one:
        args.result.write_text(json.dumps(measure(args.one, args.size, args.ranks)))
        return 0
    import torch

    if not torch.cuda.is_available():
        refuse("bench_float8_cast: needs a CUDA GPU (float8 casts are measured on the device)")
    if args.size not in SHAPES:
        refuse(f"bench_float8_cast: --size {args.size}: not a shape of scripts/lib/llama3.py ({', '.join(SHAPES)})")
    ways = [w for w in args.ways.split(",") if w]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        parser.error(f"--ways: {', '.join(unknown)} not among {', '.join(WAYS)}")
    measured = provenance(gpu_name())
    rows = []
    for way in ways:
        with tempfile.TemporaryDirectory() as scratch:  # empty compile caches: the first call pays the compile
            result = Path(scratch) / "result.json"
            env = {"TORCHINDUCTOR_CACHE_DIR": f"{scratch}/inductor", "TRITON_CACHE_DIR": f"{scratch}/triton"}
            command = [sys.executable, str(Path(__file__).resolve()), "--one", way, "--result", str(result), "--size", args.size,
                       "--ranks", str(args.ranks)]
            _, status = run_or_mark("bench_float8_cast", way, command, args.timeout, env)
            rows.append({**json.loads(result.read_text()), "status": status} if status == "ok"
                        else {"way": way, "status": status})
    rows = with_provenance(rows, measured)
    table = markdown(rows, args.size, args.ranks) + "\n\n" + provenance_line(measured)
    print(table)
    output = args.output or REPO / "scripts" / "results" / f"float8_cast_{args.size}_{args.ranks}ranks.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"size": args.size, "ranks": args.ranks, "provenance": measured, "rows": rows},
                                 indent=2) + "\n")
    output.with_suffix(".md").write_text(table + "\n")
    return exit_status("bench_float8_cast.py", [(row["way"], row["status"]) for row in rows])


def markdown(rows: List[Dict[str, Any]], size: str, ranks: int) -> str:
    """The table: a way's numbers, or what stopped it (its run failed or ran past --timeout)."""
    lines = [f"| way ({size}, a rank's shards of {ranks}) | first call s | launched ms | graphed ms | bytes as eager |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['way']} | {r['first_call_s']:.1f} | {r['launched_ms']:.2f} | {r['graphed_ms']:.2f} | "
                     f"{r['bytes_as_eager']} |" if r["status"] == "ok" else f"| {r['way']} | {r['status']} | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
