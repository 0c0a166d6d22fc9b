"""What importing ppbackward costs (Note [lazy package] in ``ppbackward``): the package, its pytest plugin and
``python -m ppbackward.run``'s usage errors import no torch; each public name imports its module when first read;
``ppbackward.backward`` imports torch but not ``torch._dynamo`` (``ppbackward._compiled.support``).

Each check runs a fresh interpreter (this one imported torch long ago) and reads ``sys.modules`` there at exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ppbackward
from ppbackward import _compiled

# runs MODULE as ``python -m MODULE ARGS`` would, then reports on stderr, at exit, which of ASKED are imported
_PROBE = """
import atexit, json, runpy, sys
module, asked, *args = sys.argv[1:]
imported = lambda: json.dumps(sorted(set(asked.split(",")) & set(sys.modules)))
atexit.register(lambda: print("IMPORTED " + imported(), file=sys.stderr))
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
_ASKED = (
    "torch", "torch._dynamo", "ppbackward", "ppbackward.pytest_plugin", "ppbackward.backward", "ppbackward._install"
)


# what would change the child's imports or pytest's plugin loading
_UNSET = ("PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_PLUGINS", "PYTHONSAFEPATH", "PYTHONSTARTUP")


def _run(module: str, *args: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``python -m MODULE ARGS`` in a fresh interpreter in ``cwd``, and which of :data:`_ASKED` it had imported at
    exit. Its own timeout comes well before pytest-timeout's (300 s), so a hang reads as one."""
    env = {k: v for k, v in os.environ.items() if k not in _UNSET}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, module, ",".join(_ASKED), *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=120,
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("IMPORTED ")]
    assert len(lines) == 1, done.stdout + done.stderr
    return done, set(json.loads(lines[0].split(" ", 1)[1]))


def _code(code: str, where: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``python -c CODE`` in a fresh interpreter (through a module of that code, written in ``where``), and what it
    imported."""
    (where / "_probe_target.py").write_text(code)
    return _run("_probe_target", cwd=where)


def test_the_package_and_its_pytest_plugin_import_no_torch(tmp_path: Path) -> None:
    done, modules = _code("import ppbackward, ppbackward.pytest_plugin\nprint(ppbackward.__version__)\n", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ppbackward.__version__
    assert modules == {"ppbackward", "ppbackward.pytest_plugin"}


def test_a_pytest_run_that_asks_for_no_leak_check_imports_no_torch(tmp_path: Path) -> None:
    """pytest loads the plugin (entry point ``pytest11``) in every run wherever ppbackward is installed."""
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert 1 + 1 == 2\n")
    done, modules = _run("pytest", "-q", "-p", "no:cacheprovider", "test_plain.py", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    assert modules == {"ppbackward", "ppbackward.pytest_plugin"}  # the plugin loaded, and nothing of torch


def test_the_launcher_s_usage_error_imports_no_torch(tmp_path: Path) -> None:
    done, modules = _run("ppbackward.run", cwd=tmp_path)
    assert done.returncode == 2
    assert "ppbackward.run: no target given" in done.stderr
    assert modules == {"ppbackward"}


def test_the_functions_module_imports_torch_but_not_dynamo(tmp_path: Path) -> None:
    done, modules = _code("import ppbackward.backward\n", tmp_path)
    assert done.returncode == 0, done.stderr
    assert modules == {"torch", "ppbackward", "ppbackward.backward"}  # not torch._dynamo


def test_reading_a_public_name_imports_its_module_and_keeps_the_name(tmp_path: Path) -> None:
    done, modules = _code("from ppbackward import stage_backward_input\n", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ppbackward.backward" in modules and "ppbackward._install" not in modules
    kept = (
        "import ppbackward\nassert 'install' not in vars(ppbackward)\n"
        "ppbackward.install\nassert 'install' in vars(ppbackward)\n"
    )
    done, modules = _code(kept, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ppbackward._install" in modules


def test_every_public_name_is_its_home_module_s_object() -> None:
    import importlib

    assert sorted(ppbackward.__all__) == sorted(ppbackward._HOMES)
    for name in ppbackward.__all__:
        assert getattr(ppbackward, name) is getattr(importlib.import_module(ppbackward._HOMES[name]), name), name
    assert set(ppbackward.__all__) <= set(dir(ppbackward))
    assert "importlib" not in dir(ppbackward) and "Any" not in dir(ppbackward)


def test_an_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(AttributeError, match="module 'ppbackward' has no attribute 'stage_backward_wieght'"):
        ppbackward.stage_backward_wieght  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ImportError, match="stage_backward_wieght"):
        from ppbackward import stage_backward_wieght  # type: ignore[attr-defined]  # noqa: F401


def test_the_compiled_split_is_supported_from_torch_2_13_and_asked_once() -> None:
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) >= (2, 13):
        assert _compiled.support() == (True, "")
    else:
        assert not _compiled.support().ok and "needs torch 2.13 or newer" in _compiled.support().why
    assert _compiled.support() is _compiled.support()  # cached: one answer per process


# a first call of B and W made inside CONTEXT, which so imports ppbackward.backward and every module it uses there
_FIRST_CALL_IN = """
import contextlib, copy, sys
import torch
from torch.overrides import TorchFunctionMode

class Tagged(torch.Tensor):
    pass

class TagResults(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out.as_subclass(Tagged) if type(out) is torch.Tensor else out

import ppbackward as pb
torch.manual_seed(0)
mod = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
ref = copy.deepcopy(mod)
x = torch.randn(3, 4, requires_grad=True)
out = mod(x)
ref(x.detach()).backward(torch.ones(3, 4))
def strict_pack(t):
    raise AssertionError("a saved tensor was packed")

contexts = {
    "no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "mode": TagResults,
    "saved_hooks": lambda: torch.autograd.graph.saved_tensors_hooks(strict_pack, lambda t: t),
}
with contexts[sys.argv[1]]():
    b = pb.stage_backward_input
w = pb.stage_backward_weight
_, groups = b((out,), (torch.ones(3, 4),), [x], mod.parameters())
w(mod.parameters(), groups)
assert all(torch.equal(p.grad, q.grad) for p, q in zip(mod.parameters(), ref.parameters())), "grads differ"
print("EXACT")
"""


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "mode", "saved_hooks"])
def test_a_first_read_inside_a_callers_context_imports_probes_that_still_hold(context: str, tmp_path: Path) -> None:
    """Reading ``ppbackward.stage_backward_input`` first inside ``torch.no_grad()`` or inference mode imported
    ``ppbackward.backward`` there, whose module-level probe of the ``AccumulateGrad`` type found no ``grad_fn``
    (``AttributeError``); inside a ``TorchFunctionMode`` that tags results, the probe read a view's type instead, and W
    gave no weight a gradient; inside saved-tensor hooks, the probes' matmuls handed their tensors to the caller's pack
    hook, which here refuses any (Note [probes run in plain autograd] in ``ppbackward._plain``; a reviewer's and a
    hostile tester's)."""
    script = tmp_path / "first_call.py"
    script.write_text(_FIRST_CALL_IN)
    env = {k: v for k, v in os.environ.items() if k not in _UNSET}
    done = subprocess.run([sys.executable, str(script), context], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "EXACT" in done.stdout, done.stderr[-2000:]


# the first W of the process that calls an intermediate again (an einsum), under a mode that tags its results: W's
# anchors, made then and kept, must be plain tensors, and later W meet no subclass
_ANCHORS_MADE_IN_A_MODE = """
import torch
from torch.overrides import TorchFunctionMode
import ppbackward as pb
from ppbackward import _weight_edges

class Tagged(torch.Tensor):
    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Tagged.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})

class TagResults(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunction():
            out = func(*args, **(kwargs or {}))
        return out.as_subclass(Tagged) if type(out) is torch.Tensor else out

weight = torch.nn.Parameter(torch.randn(8, 8))
def step(mode):
    x = torch.randn(4, 8, requires_grad=True)
    out = torch.einsum("bi,ij->bj", x, weight)
    _, groups = pb.stage_backward_input((out,), (torch.ones(4, 8),), [x], [weight])
    if mode:
        with TagResults():
            pb.stage_backward_weight([weight], groups)
    else:
        pb.stage_backward_weight([weight], groups)
step(True)
kept = {str(d): [type(t).__name__ for t in pair] for d, pair in _weight_edges._ANCHORS.items()}
assert kept == {"cpu": ["Tensor", "Tensor"]}, kept
Tagged.calls = 0
step(False)
assert Tagged.calls == 0, Tagged.calls
print("PLAIN")
"""


def test_w_s_anchors_made_inside_a_callers_mode_are_plain_tensors(tmp_path: Path) -> None:
    """W's anchors (Note [W's anchor runs no kernel] in ``ppbackward._weight_edges``) are made at the first W on a
    device and kept: made inside a ``TorchFunctionMode`` that tags results they were the mode's subclass, whose
    ``__torch_function__`` then ran in every later W with no mode active (a hostile tester's)."""
    script = tmp_path / "anchors.py"
    script.write_text(_ANCHORS_MADE_IN_A_MODE)
    env = {k: v for k, v in os.environ.items() if k not in _UNSET}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "PLAIN" in done.stdout, done.stderr[-2000:]
