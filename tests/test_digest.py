"""graphing.weights_digest: one digest of the weights, whatever their split. The same weights digest alike
whole (each DDP rank its own replica) and sharded with FSDP2, on one rank and on two; one element changed
by one ulp, or the parameters taken in another order, digest otherwise. The trainer's results carry it
(``param_digests``), and a 2-rank fsdp2 run gathers no parameter whole (tests/test_fsdp_training.py).
"""
from __future__ import annotations

import json

import pytest
import torch

from helpers.launches import launch_together


@pytest.fixture(scope="module")
def digests(tmp_path_factory):
    root = tmp_path_factory.mktemp("digests")
    runs = launch_together({f"world{n}": [str(root)] for n in (1, 2)}, None, script="tests/helpers/digest_ranks.py",
                           each={f"world{n}": {"nproc": n} for n in (1, 2)}, timeout=120)
    for run in runs.values():
        assert run.returncode == 0, run.output[-3000:]
    return {path.stem: json.loads(path.read_text()) for path in root.glob("rank*_of*.json")}


def test_the_same_weights_digest_alike_whole_and_sharded_on_one_rank_and_two(digests):
    assert sorted(digests) == ["rank0_of1", "rank0_of2", "rank1_of2"]
    # Rows that do not split evenly, and a one-row parameter whose second shard is empty.
    assert digests["rank0_of2"]["shards"] == [[2, 5], [2], [1, 3], [1], [4, 2]]
    assert digests["rank1_of2"]["shards"] == [[1, 5], [1], [0, 3], [0], [3, 2]]
    whole = digests["rank0_of1"]["whole"]
    assert {d["whole"] for d in digests.values()} == {d["sharded"] for d in digests.values()} == {whole}
    # The digest can tell: one ulp in one element, or the same tensors in another order.
    for d in digests.values():
        assert d["one_element_changed"] != whole and d["parameters_reordered"] != whole


@pytest.mark.fast
def test_a_digest_is_computed_where_the_weights_are_and_keys_every_element_by_its_place():
    from graphing import weights_digest

    a = torch.nn.Linear(4, 4)
    b = torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    assert weights_digest(a) == weights_digest(b)
    with torch.no_grad():  # the same values in other places: a transposed weight
        b.weight.copy_(a.weight.t())
    assert weights_digest(a) != weights_digest(b)
    # bf16 weights digest as their exact float32 widening: the same values in either dtype agree.
    assert weights_digest(a.to(torch.bfloat16).float()) == weights_digest(a.to(torch.bfloat16))
    assert len(weights_digest(a)) == 16 and weights_digest(torch.nn.Module()) == "0" * 16
