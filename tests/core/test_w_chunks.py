"""Note [W in chunks]: W split into chunks of param groups stays exact and fires every hook once.

The zoo stages are far below W's 4 MiB chunk, so each is one chunk by default; these tests lower the
limit to 1 byte (every param group its own chunk, the most engine calls W can make) and rerun the
exactness, hook and property tests under it.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import ppbackward as pb
import ppbackward._handoff as handoff
import ppbackward.backward as backward
from tests.core import test_exactness, test_hooks, test_random_stages
from tests.core.helpers import clone_inputs, output_grads
from tests.core.stages import ZOO, build


@pytest.fixture
def one_group_per_chunk(monkeypatch):
    chunks = []
    real = handoff._weight_work

    def spy(groups):
        chunks.append(len(groups))
        return real(groups)

    monkeypatch.setattr(handoff, "_W_CHUNK_BYTES", 1)
    monkeypatch.setattr(handoff, "_weight_work", spy)
    return chunks


def test_chunks_partition_the_groups_in_order_by_parameter_bytes():
    def group(*numels):
        return backward.ParamGroup([], [], [torch.zeros(n) for n in numels])  # float32: 4 bytes each

    groups = [group(1), group(2), group(5), group(1), group(1)]
    assert [len(c) for c in handoff._runs(groups, 12)] == [2, 1, 2]  # 12 B, 20 B, 8 B (last, smaller)
    assert [g for c in handoff._runs(groups, 12) for g in c] == groups
    assert [len(c) for c in handoff._runs(groups, 1)] == [1] * 5
    assert [len(c) for c in handoff._runs(groups, 10**9)] == [5]
    assert list(handoff._runs([], 1)) == []


@pytest.mark.parametrize("order", ["BWBW", "BBWW-reversed"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_split_matches_plain_autograd_one_group_per_chunk(one_group_per_chunk, name, order):
    test_exactness.test_split_matches_plain_autograd(name, order)
    assert all(n == 1 for n in one_group_per_chunk)


def test_a_stage_of_several_groups_is_split(one_group_per_chunk):
    test_exactness.test_split_matches_plain_autograd("transformer", "BWBW")
    assert len(one_group_per_chunk) > 2 * 2, "two microbatches, more than two chunks each"


@pytest.mark.parametrize("name", ["mlp", "shared_late", "multi_output_nodes", "weight_only_paths", "transformer"])
def test_hooks_fire_once_one_group_per_chunk(one_group_per_chunk, name):
    test_hooks.test_hooks_fire_once_per_param_per_microbatch_in_w_never_in_b(name)
    # every parameter has a tensor hook there: each W joins its chunks into one (Note [parameters with tensor
    # hooks accumulate in one call])
    assert len(one_group_per_chunk) == 2


@pytest.mark.parametrize("name", ["mlp", "shared_late", "multi_output_nodes", "weight_only_paths", "transformer"])
def test_post_accumulate_hooks_fire_once_and_w_stays_one_group_per_chunk(one_group_per_chunk, name):
    module, make_inputs = build(name)
    fired: Counter[str] = Counter()
    for n, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: fired.update([n]))
    xs = clone_inputs(make_inputs(0))
    out = module(*xs)
    _, groups = pb.stage_backward_input(out, output_grads(out), xs, module.parameters())
    n_groups = len(groups)
    pb.stage_backward_weight(module.parameters(), groups)
    assert one_group_per_chunk == [1] * n_groups
    assert set(fired.values()) == {1} and len(fired) >= n_groups


def test_random_stages_one_group_per_chunk(one_group_per_chunk):
    test_random_stages.test_random_stage_split_full_plain_agree()
