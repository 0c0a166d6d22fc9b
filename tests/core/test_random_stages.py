"""Property-based: random small stages (DAGs of linear / elementwise / split / concat ops with shared
and frozen parameters and random outputs); split B/W, full stage_backward and plain autograd agree."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ppbackward as pb
from tests.core.helpers import assert_grads_equal, assert_param_grads, clone_inputs, output_grads, reference

D = 4
OPS = ("linear", "scale", "tanh", "add", "mul", "split_cat", "unbind_stack", "cat_slice", "weight_only")


class RandomStage(nn.Module):
    """Runs a fixed program over a pool of values; parameters may be shared and frozen."""

    def __init__(self, program, n_mat, n_vec, frozen, outputs):
        super().__init__()
        self.mats = nn.ParameterList(nn.Parameter(torch.randn(D, D, dtype=torch.float64) / 2) for _ in range(n_mat))
        self.vecs = nn.ParameterList(nn.Parameter(torch.randn(D, dtype=torch.float64)) for _ in range(n_vec))
        for i in frozen:
            params = list(self.mats) + list(self.vecs)
            params[i % len(params)].requires_grad_(False)
        self.program = program
        self.outputs = outputs

    def forward(self, *inputs):
        vals = [x for x in inputs]
        for op, a, b, p in self.program:
            va, vb = vals[a % len(vals)], vals[b % len(vals)]
            mat, vec = self.mats[p % len(self.mats)], self.vecs[p % len(self.vecs)]
            if op == "linear":
                v = va @ mat
            elif op == "scale":
                v = va * vec
            elif op == "tanh":
                v = torch.tanh(va)
            elif op == "add":
                v = va + vb
            elif op == "mul":
                v = va * vb
            elif op == "split_cat":
                left, right = va.split([1, D - 1], dim=-1)
                v = torch.cat([right * vec[1:], left], dim=-1)
            elif op == "unbind_stack":
                v = torch.stack(va.unbind(0)[::-1]) @ mat
            elif op == "cat_slice":
                v = torch.cat([va, vb], dim=0)[1:3] * vec
            else:  # weight_only: a path that never touches the inputs
                v = va + torch.tanh(vec).expand(2, D) @ mat
            vals.append(v)
        picked = [vals[len(inputs) + (i % (len(vals) - len(inputs)))] for i in self.outputs]
        return tuple(picked)


program_st = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 50), st.integers(0, 50), st.integers(0, 50)),
    min_size=1,
    max_size=8,
)
# One random stage: its program, parameter counts, frozen parameters, outputs and which inputs need grad.
stage_st = dict(
    program=program_st,
    n_mat=st.integers(1, 3),
    n_vec=st.integers(1, 3),
    frozen=st.lists(st.integers(0, 5), max_size=2),
    outputs=st.lists(st.integers(0, 50), min_size=1, max_size=3),
    input_grad=st.lists(st.booleans(), min_size=1, max_size=2),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**stage_st)
def test_random_stage_split_full_plain_agree(program, n_mat, n_vec, frozen, outputs, input_grad):
    torch.manual_seed(0)
    module = RandomStage(program, n_mat, n_vec, frozen, outputs)

    def make_inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(2, D, generator=g, dtype=torch.float64).requires_grad_(r) for r in input_grad]

    inputs = [make_inputs(1), make_inputs(2)]
    ref_in, ref_params = reference(module, inputs)

    full, split = copy.deepcopy(module), copy.deepcopy(module)
    pending = []
    for k, mb in enumerate(inputs):
        xf, xs = clone_inputs(mb), clone_inputs(mb)
        out_f = full(*xf)
        got_f = pb.stage_backward(out_f, output_grads(out_f, 100 + k), xf)
        out_s = split(*xs)
        got_s, groups = pb.stage_backward_input(out_s, output_grads(out_s, 100 + k), xs, split.parameters())
        for i, e in enumerate(ref_in[k]):
            assert_grads_equal(got_f[i], e, f"full input[{i}]")
            assert_grads_equal(got_s[i], e, f"split input[{i}]")
        pending.append(groups)
    for groups in pending:  # B B W W
        pb.stage_backward_weight(split.parameters(), groups)
    assert_param_grads(full, ref_params, "full")
    assert_param_grads(split, ref_params, "split")
