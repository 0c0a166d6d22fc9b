"""install() on a torch newer than the newest known release (Note [untested newer torch]), with a
fake ``torch.__version__`` and stand-in or altered ``stage.py`` sources: refused by default in one
line that names the opt-in; with ``allow_untested=True`` or ``PPBACKWARD_ALLOW_UNTESTED_TORCH=1``,
the newest known contract's adapter when the shape matches (with an ``UntestedTorchWarning``),
refused when it does not or cannot be read. Every refusal patches nothing."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch.distributed.pipelining import _backward as upstream_backward
from torch.distributed.pipelining import stage as upstream_stage

import ppbackward as pb
from ppbackward import _compat, active_adapter

NAMES = ("stage_backward", "stage_backward_input", "stage_backward_weight")
ENV = "PPBACKWARD_ALLOW_UNTESTED_TORCH"
NEWER = "2.16.0.dev20261201+cpu"
NEWEST = _compat._CONTRACTS[-1]

# The 2.15 shape in a few lines: the tuple shape of 2.6+, plus outputs released after their send and
# handed over as gradient edges.
_STAND_IN_2_15 = """
class _PipelineStageBase:
    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        grads, param_groups = run(backward_type)
        return grads, param_groups

    def _make_forward_chunk_state(self, outputs):
        return [get_gradient_edge(out) for out in outputs]

    def release_fwd_send_outputs(self, fwd_chunk_id):
        self.live[fwd_chunk_id] = None

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if full_backward:
            grads_input, _ = self.backward_maybe_with_nosync("full", {})
        elif not self.is_first:
            grads_input, param_groups = self.backward_maybe_with_nosync("input", {})
"""


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    pb.uninstall()
    yield
    pb.uninstall()


def _current():
    return {(m.__name__, n): getattr(m, n) for m in (upstream_backward, upstream_stage) for n in NAMES}


def _newer_torch(monkeypatch, source: str | None) -> None:
    """Make the installed torch look like ``NEWER`` with a ``stage.py`` of ``source`` (None: none)."""
    monkeypatch.setattr(torch, "__version__", NEWER)
    shape = None if source is None else _compat.probe_stage_shape(source)
    monkeypatch.setattr(_compat, "probe_stage_shape", lambda source=None: shape)


def _installed_source_without_edges() -> str:
    """The installed stage.py with the output release and the gradient edges renamed away."""
    source = inspect.getsource(upstream_stage)
    return source.replace("release_fwd_send_outputs", "release_outputs_elsewhere").replace(
        "get_gradient_edge", "edge_elsewhere"
    )


def test_the_2_15_stand_in_has_the_newest_known_shape():
    assert _compat.probe_stage_shape(_STAND_IN_2_15) == _compat._EDGE_ROOTS_SHAPE == NEWEST.shape


def test_newer_torch_is_refused_by_default_in_one_line_naming_the_opt_in(monkeypatch):
    originals = _current()
    _newer_torch(monkeypatch, _STAND_IN_2_15)
    with pytest.raises(pb.UnsupportedTorchError) as info:
        pb.install()
    message = str(info.value)
    assert "\n" not in message and f"torch {NEWER}" in message and pb.SUPPORTED_TORCH in message
    assert "install(allow_untested=True)" in message and f"{ENV}=1" in message
    assert f"torch {NEWEST.name} adapter" in message
    assert not pb.is_installed() and active_adapter() is None
    assert all(_current()[k] is originals[k] for k in originals)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_opt_in_puts_in_the_newest_adapter_with_a_warning_when_the_shape_matches(how, monkeypatch):
    originals = _current()
    _newer_torch(monkeypatch, _STAND_IN_2_15)
    if how == "environment":
        monkeypatch.setenv(ENV, "1")
    with pytest.warns(pb.UntestedTorchWarning) as caught:
        pb.install(allow_untested=True) if how == "argument" else pb.install()
    text = str(caught[0].message)
    assert f"torch {NEWER}" in text and f"torch {NEWEST.name}" in text
    assert ("allow_untested=True" if how == "argument" else f"{ENV}=1") in text
    adapter = active_adapter()
    assert adapter is not None and adapter.untested and adapter.shape_checked
    assert adapter.contract == NEWEST and adapter.version == NEWER
    assert adapter.name.endswith(f"(torch {NEWEST.name} contract, untested on torch {NEWER})")
    for (_, name), obj in _current().items():
        assert obj is adapter.functions[name] is getattr(pb, name)
    pb.uninstall()
    assert all(_current()[k] is originals[k] for k in originals)


@pytest.mark.parametrize(
    "source", ["older shape", "installed, edges renamed away", "no source"], ids=str
)
def test_opt_in_refuses_a_stage_py_without_the_newest_shape_and_patches_nothing(source, monkeypatch):
    originals = _current()
    text = {
        "older shape": _STAND_IN_2_15.replace("release_fwd_send_outputs", "drop").replace(
            "get_gradient_edge", "edge_of"
        ),
        "installed, edges renamed away": _installed_source_without_edges(),
        "no source": None,
    }[source]
    # the installed stage.py has its release's shape (2.5's legacy one on torch 2.5), its edges renamed away
    installed = _compat.contract_for().shape._replace(roots_may_be_edges=False)
    found = _compat._TUPLE_SHAPE if source == "older shape" else installed
    _newer_torch(monkeypatch, text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refusal warns nothing
        with pytest.raises(pb.UnsupportedTorchError) as info:
            pb.install(allow_untested=True)
    message = str(info.value)
    assert "\n" not in message and f"torch {NEWER}: its torch/distributed/pipelining/stage.py" in message
    if text is None:
        assert "cannot be read" in message
    else:
        assert f"found {found}, expected {NEWEST.shape}" in message
    assert not pb.is_installed() and active_adapter() is None
    assert all(_current()[k] is originals[k] for k in originals)


def test_opt_in_on_the_installed_stage_py(monkeypatch):
    """The installed torch's own stage.py under a newer version: accepted exactly when it has the
    newest known shape (torch 2.15), refused otherwise (2.14 and older)."""
    shape = _compat.probe_stage_shape()
    monkeypatch.setattr(torch, "__version__", NEWER)
    if shape == NEWEST.shape:
        with pytest.warns(pb.UntestedTorchWarning):
            pb.install(allow_untested=True)
        assert active_adapter().untested
    else:
        with pytest.raises(pb.UnsupportedTorchError, match="does not have the shape"):
            pb.install(allow_untested=True)
        assert not pb.is_installed()


def test_an_explicit_false_overrides_the_environment(monkeypatch):
    _newer_torch(monkeypatch, _STAND_IN_2_15)
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(pb.UnsupportedTorchError, match="allow_untested=True"):
        pb.install(allow_untested=False)
    assert not pb.is_installed()


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_a_bad_environment_value_is_named_on_a_newer_torch(value, monkeypatch):
    _newer_torch(monkeypatch, _STAND_IN_2_15)
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=rf"{ENV}='{value}': expected 1"):
        pb.install()
    assert not pb.is_installed()


def test_the_opt_in_changes_nothing_on_a_known_torch(monkeypatch):
    monkeypatch.setenv(ENV, "yes")  # not read on a known torch
    expected = _compat.select_adapter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pb.install(allow_untested=True)
    adapter = active_adapter()
    assert not adapter.untested and adapter.contract == expected.contract


@pytest.mark.parametrize("version", ["2.4.1", "1.13.1"])
def test_the_opt_in_does_not_admit_an_older_torch(version):
    with pytest.raises(pb.UnsupportedTorchError, match="older than the oldest"):
        _compat.select_adapter(version, _compat._TUPLE_SHAPE, allow_untested=True)


def test_select_adapter_without_opt_in_refuses_newer_even_with_the_right_shape():
    with pytest.raises(pb.UnsupportedTorchError, match="newer than the newest"):
        _compat.select_adapter("2.16.0", NEWEST.shape)
    chosen = _compat.select_adapter("2.16.0", NEWEST.shape, allow_untested=True)
    assert chosen.untested and chosen.contract == NEWEST
