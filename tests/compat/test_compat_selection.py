"""Adapter selection from a torch version and the shape of its stage.py (no process group, no
graph): the contract table, refusals, the stage.py probe on small stand-in sources and on the
installed torch, and install() putting in exactly the selected adapter's functions."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining import _backward as upstream_backward
from torch.distributed.pipelining import stage as upstream_stage

import ppbackward as pb
from ppbackward import _compat, _node_owner, active_adapter
from tests.core.stages import Double

NAMES = ("stage_backward", "stage_backward_input", "stage_backward_weight")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "version, contract, adapter",
    [
        ("2.5.0", "2.5", "legacy"),
        ("2.5.1+cu124", "2.5", "legacy"),
        ("2.6.0", "2.6-2.7", "native"),
        ("2.7.1+cpu", "2.6-2.7", "native"),
        ("2.8.0", "2.8-2.11", "native"),
        ("2.11.0", "2.8-2.11", "native"),
        ("2.12.1", "2.12-2.14", "native"),
        ("2.13.0+cpu", "2.12-2.14", "native"),
        ("2.14.1", "2.12-2.14", "native"),
        ("2.15.0", "2.15", "native"),
        ("2.15.0+cu132", "2.15", "native"),
    ],
)
def test_adapter_for_each_supported_version(version, contract, adapter):
    chosen = _compat.select_adapter(version)
    assert chosen.contract.name == contract and chosen.contract.adapter == adapter
    assert chosen.version == version and not chosen.shape_checked
    assert set(chosen.functions) == set(NAMES)
    if adapter == "legacy":
        assert chosen.functions["stage_backward"] is _compat.legacy_stage_backward
        assert chosen.functions["stage_backward_weight"] is _compat.legacy_stage_backward_weight
    else:  # stage.py of 2.6+ consumes ppbackward's functions as they are
        assert chosen.functions["stage_backward"] is pb.stage_backward
        assert chosen.functions["stage_backward_weight"] is pb.stage_backward_weight


@pytest.mark.parametrize("version", ["1.13.1", "2.4.1", "2.16.0", "2.16.0.dev20261201", "3.0.0"])
def test_versions_outside_the_range_are_refused(version):
    with pytest.raises(pb.UnsupportedTorchError) as info:
        _compat.select_adapter(version)
    assert f"torch {version}" in str(info.value) and pb.SUPPORTED_TORCH in str(info.value)


def test_unparsable_version_is_refused():
    with pytest.raises(pb.UnsupportedTorchError, match="cannot parse"):
        _compat.select_adapter("nightly")


@pytest.mark.parametrize(
    "version, wrong_shape",
    [
        ("2.5.1", _compat._TUPLE_SHAPE),
        ("2.9.1", _compat._LEGACY_SHAPE),
        ("2.13.0", _compat._LEGACY_SHAPE),
        ("2.14.1", _compat._EDGE_ROOTS_SHAPE),  # a 2.14 stage.py that releases outputs: not 2.14's
        ("2.15.0", _compat._TUPLE_SHAPE),  # a 2.15 whose stage.py hands over no edges: not 2.15's
    ],
)
def test_a_stage_py_of_unexpected_shape_is_refused(version, wrong_shape):
    with pytest.raises(
        pb.UnsupportedTorchError, match=rf"torch {re.escape(version)}: .*stage\.py"
    ) as info:
        _compat.select_adapter(version, shape=wrong_shape)
    assert "found" in str(info.value) and "expected" in str(info.value)


def test_node_owner_is_reported_and_native_b_is_ppbackwards_own_either_way(monkeypatch):
    monkeypatch.setattr(_compat, "custom_nodes_need_owner", lambda: True)
    owned = _compat.select_adapter("2.6.0")
    assert owned.owns_custom_nodes and "+node-owner" in owned.name
    assert owned.functions["stage_backward_input"] is pb.stage_backward_input  # B keeps the owners itself
    monkeypatch.setattr(_compat, "custom_nodes_need_owner", lambda: False)
    plain = _compat.select_adapter("2.6.0")
    assert not plain.owns_custom_nodes
    assert plain.functions["stage_backward_input"] is pb.stage_backward_input


# --- the stage.py probe, on small stand-ins written for these tests ------------------------------

_STAND_IN_2_5 = """
class _PipelineStageBase:
    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs):
        result = run(backward_type)
        if isinstance(result, tuple) and len(result) == 2:
            grads, param_groups = result
        else:
            grads, param_groups = result, None
        return grads, param_groups

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True):
        if full_backward:
            self.grads_input, _ = self.backward_maybe_with_nosync("full", {})
        else:
            self.grads_input, groups = self.backward_maybe_with_nosync("input", {})
"""

_STAND_IN_2_6 = """
class _PipelineStageBase:
    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        result = run(backward_type)
        grads, param_groups = result
        return grads, param_groups

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if full_backward:
            grads_input, _ = self.backward_maybe_with_nosync("full", {})
        else:
            param_groups = None
            if not self.is_first:
                grads_input, param_groups = self.backward_maybe_with_nosync("input", {})
"""


def test_probe_reads_both_known_shapes():
    assert _compat.probe_stage_shape(_STAND_IN_2_5) == _compat._LEGACY_SHAPE
    assert _compat.probe_stage_shape(_STAND_IN_2_6) == _compat._TUPLE_SHAPE


@pytest.mark.parametrize("source", ["", "class Other:\n    pass\n", "def (:"])
def test_probe_gives_none_when_it_cannot_tell(source):
    assert _compat.probe_stage_shape(source) is None


def test_installed_stage_py_has_the_shape_of_its_version():
    shape = _compat.probe_stage_shape()
    assert shape is not None, "the installed torch ships stage.py as source"
    assert shape == _compat.contract_for().shape


def test_custom_node_probe_matches_what_torch_does():
    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * w

        @staticmethod
        def backward(ctx, g):
            return g, g

    def survives(edge) -> bool:
        try:
            _ = edge.node.next_functions
            return True
        except RuntimeError:
            return False

    x = torch.ones(2, requires_grad=True)
    out = Double.apply(x)
    root = torch.autograd.graph.get_gradient_edge(out)  # how B holds an output edge
    out.detach_()
    top = Mul.apply(x, Double.apply(x))
    weight = GradientEdge(*top.grad_fn.next_functions[1][:2])  # a custom intermediate's weight edge
    del top
    assert _node_owner.custom_nodes_need_owner() is not (survives(root) and survives(weight))


# --- install() with the installed torch ---------------------------------------------------------


def _current():
    return {
        (m.__name__, n): getattr(m, n) for m in (upstream_backward, upstream_stage) for n in NAMES
    }


def test_install_puts_in_the_selected_adapter_and_uninstall_restores():
    originals = _current()
    expected = _compat.select_adapter()
    pb.install()
    adapter = active_adapter()
    assert adapter is not None and adapter.shape_checked
    assert adapter.contract == expected.contract and adapter.version == torch.__version__
    for (_, name), obj in _current().items():
        assert obj is adapter.functions[name]
    pb.uninstall()
    assert active_adapter() is None
    assert _current() == originals and all(_current()[k] is originals[k] for k in originals)


def test_install_refuses_a_stage_py_it_does_not_recognise_and_patches_nothing(monkeypatch):
    originals = _current()
    other = (
        _compat._TUPLE_SHAPE
        if _compat.contract_for().adapter == "legacy"
        else _compat._LEGACY_SHAPE
    )
    monkeypatch.setattr(_compat, "probe_stage_shape", lambda source=None: other)
    with pytest.raises(pb.UnsupportedTorchError, match=r"stage\.py"):
        pb.install()
    assert not pb.is_installed() and active_adapter() is None
    assert all(_current()[k] is originals[k] for k in originals)


def test_install_trusts_the_version_when_stage_py_has_no_source(monkeypatch):
    monkeypatch.setattr(_compat, "probe_stage_shape", lambda source=None: None)
    with pb.installed():
        assert active_adapter() is not None and not active_adapter().shape_checked


def test_supported_range_matches_pyproject():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib  # type: ignore[import-not-found,unused-ignore]  # 3.11+: mypy checks as 3.10

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = next(d for d in project["dependencies"] if re.match(r"torch\b", d))
    assert torch_req.replace(" ", "") == f"torch{pb.SUPPORTED_TORCH}"
