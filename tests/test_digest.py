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


@pytest.mark.fast
def test_graphing_reads_a_dtensor_through_one_module_whole_local_and_laid_out(monkeypatch):
    # graphing/sharded.py on a model sharded with FSDP2 over a gloo group of one: the local tensor is the very one
    # the DTensor holds (an attribute set on it stays, as torchao's float8 scale does), its place in the whole,
    # its whole value; RunningMeans takes a DTensor whole; the old compat name still answers, warning once.
    import warnings

    from torch.distributed.fsdp import fully_shard

    from graphing import RunningMeans, deprecation
    from graphing.sharded import is_dtensor, local_part, local_tensor, whole_value
    from helpers.one_rank import group_of_one

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    whole = [p.detach().clone() for p in model.parameters()]
    with group_of_one("gloo"):
        fully_shard(model)
        weight = model[0].weight
        assert is_dtensor(weight) and not is_dtensor(whole[0])
        local_tensor(weight).marker = "scale"
        assert getattr(local_tensor(weight), "marker", None) == "scale" and local_tensor(whole[0]) is whole[0]
        part = local_part(weight)
        assert part.offset == (0, 0) and part.counts and part.sharded and "Shard(dim=0)" in part.layout
        assert torch.equal(part.values, whole[0]) and torch.equal(whole_value(weight), whole[0])
        plain = local_part(whole[0])
        assert plain.values is whole[0] and plain.offset == (0, 0) and not plain.sharded and plain.layout == ""
        model(torch.randn(4, 3)).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, foreach=True)
        assert is_dtensor(norm)
        means = RunningMeans(["grad_norm"], "cpu")
        means.add(grad_norm=norm)
        assert means.read_and_reset()["grad_norm"] == pytest.approx(float(whole_value(norm)))
        import graphing.compat

        monkeypatch.setattr(deprecation, "_warned", set())
        with pytest.warns(DeprecationWarning, match="graphing.compat.dtensor_local_offset is deprecated: use "
                                                    "graphing.sharded.local_part"):
            old = graphing.compat.dtensor_local_offset
        assert old(weight) == ((0, 0), True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert graphing.compat.dtensor_local_offset is old  # once per process
