"""Two nodes, simulated on one machine: two torchrun agents meet through a c10d rendezvous.

This is what `scripts/slurm/train.sbatch` does on a cluster (one agent per node, the
same --rdzv-id and --rdzv-endpoint everywhere), with gloo on the CPU instead of NCCL. Its Python processes
may be warm forks (helpers/warm.py): the test is about agents and ranks agreeing on one job, not about signals
or how processes end.
"""
from __future__ import annotations

import ast
import json
import uuid

from helpers.launches import Launch, free_port

AGENT_TIMEOUT_S = 180  # usually 30-60 s: 4 ranks and 2 agents share a small CI machine


def _agent(node: int, port: int, run_id: str, output_root, log_dir) -> Launch:
    """One torchrun agent = one node. On one machine, say which agent hosts the rendezvous store."""
    return Launch(["experiment=debug", "logger=none", f"output_root={output_root}", "train.max_steps=10",
                   "train.epochs=2", "train.progress=false"], log_dir, name=f"node{node}", nproc=2,
                  torchrun_args={"rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_id": run_id,
                                 "extra": ["--nnodes=2", f"--rdzv-conf=is_host={1 if node == 0 else 0}"]},
                  merge_output=True)


def _summary(rank_log) -> dict:
    """The trainer's final summary, as each rank logs it (``summary: {...}``)."""
    lines = [line for line in rank_log.read_text().splitlines() if " train: summary: " in line]
    assert len(lines) == 1, f"{rank_log.name}: expected one summary line, found {len(lines)}"
    return ast.literal_eval(lines[0].split(" train: summary: ", 1)[1])


def test_two_nodes_of_two_ranks_train_as_one_job_of_four(tmp_path):
    output_root, log_dir = tmp_path / "outputs", tmp_path / "agents"
    log_dir.mkdir()
    port, run_id = free_port(), f"multinode-{uuid.uuid4().hex[:8]}"
    agents = [_agent(node, port, run_id, output_root, log_dir) for node in (0, 1)]
    try:
        codes = [agent.finish(timeout=AGENT_TIMEOUT_S).returncode for agent in agents]
    finally:
        for agent in agents:
            agent.kill()  # the other node's agent, if one of them ran past its time
    output = "\n".join(f"--- node {n} ---\n{(log_dir / f'node{n}.out').read_text()[-3000:]}" for n in (0, 1))
    assert codes == [0, 0], output

    # All four ranks agreed on one run directory (named after the rendezvous id).
    run_dirs = sorted(p.parent for p in output_root.rglob("config.yaml"))
    assert len(run_dirs) == 1, f"expected one run directory, found {run_dirs}\n{output}"
    run_dir = run_dirs[0]
    assert run_id in run_dir.name
    assert (run_dir / "results.json").is_file()
    assert sorted(p.name for p in run_dir.glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]

    results = json.loads((run_dir / "results.json").read_text())
    assert results["world_size"] == 4 and results["steps"] == 10

    # Every rank finished the same job: same world, same step count, the same
    # all-reduced losses (each rank computed them from its own replica of the model).
    summaries = [_summary(run_dir / f"rank{r}.log") for r in range(4)]
    for rank, s in enumerate(summaries):
        assert s["world_size"] == 4 and s["steps"] == 10, f"rank {rank}: {s}"
        for key in ("final/loss", "final/eval_loss", "final/eval_samples"):
            assert s[key] == summaries[0][key], f"rank {rank} disagrees on {key}: {s[key]} vs {summaries[0][key]}"
    assert summaries[0]["final/eval_samples"] == 512  # the whole test set, split over 4 ranks, counted once
