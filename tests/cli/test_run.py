"""``python -m ppbackward.run``: the zero-code launcher (install, then run the target as ``__main__``).

Cost: each test starts one interpreter that imports torch (a few seconds each on 2 CPU cores); the torchrun
test starts torchrun with 2 ranks once (about 15 s idle). Every subprocess has a timeout that kills its
whole session, and a failure shows its output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import ppbackward
from ppbackward._compat import torch_release

SRC = str(Path(ppbackward.__file__).resolve().parents[1])
_TIMEOUT_S = 240

# What a target reports about the process it runs in: one JSON line on stdout (or into $PROBE_OUT/<rank>).
PROBE = textwrap.dedent(
    """
    import json, logging, os, sys
    import ppbackward
    import torch.distributed.pipelining._backward as b
    import torch.distributed.pipelining.stage as s
    report = {
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "installed": ppbackward.is_installed(),
        "swapped": s.stage_backward_input is ppbackward.stage_backward_input
                   and b.stage_backward_weight is ppbackward.stage_backward_weight,
        "rank": os.environ.get("RANK"),
        "merging": ppbackward._install.merge_bw_enabled(),
        "logging": [len(logging.getLogger().handlers), len(logging.getLogger("ppbackward").handlers),
                    logging.getLogger("ppbackward").level],
    }
    out = os.environ.get("PROBE_OUT")
    if out:
        open(os.path.join(out, f"rank{report['rank']}.json"), "w").write(json.dumps(report))
    else:
        print(json.dumps(report))
    code = os.environ.get("PROBE_EXIT")
    if code == "raise":
        raise ValueError("probe failed on purpose")
    if code == "hooked":
        sys.excepthook = lambda kind, value, tb: print(f"HOOKED {kind.__name__}: {value}", file=sys.stderr)
        raise ValueError("probe failed on purpose")
    if code:
        sys.exit(int(code))
    """
)


def _python(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` with this checkout's ppbackward; bounded by ``_TIMEOUT_S`` (session killed)."""
    full_env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"python {' '.join(args)} still running after {_TIMEOUT_S}s; output:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "probe.py").write_text(PROBE)
    (folder / "probe_mod.py").write_text(PROBE)
    return folder / "probe.py"


def _report(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.stdout.strip(), result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_script_runs_as_main_with_ppbackward_installed(probe, tmp_path):
    args = ["--flag", "1", "-m", "x", "--", "-h"]
    result = _python("-m", "ppbackward.run", str(probe), *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = _report(result)
    assert report == {**report, "name": "__main__", "argv": [str(probe), *args], "path0": str(probe.parent),
                      "installed": True, "swapped": True, "merging": False}
    plain = _report(_python(str(probe), *args, cwd=tmp_path))  # what `python SCRIPT` gives
    assert (plain["argv"], plain["path0"], plain["installed"]) == (report["argv"], report["path0"], False)


INSTALLED = f"ppbackward {ppbackward.__version__} installed: torch "  # Note [install says so]


def test_the_launcher_says_ppbackward_is_installed_and_leaves_logging_as_it_found_it(probe, tmp_path):
    """A newcomer could not tell that ``python -m ppbackward.run`` did anything: it prints one line on stderr
    (install's log record, Note [run shows the install]); the target then finds logging unconfigured."""
    result = _python("-m", "ppbackward.run", str(probe), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(INSTALLED) and line.endswith(", merge_bw off)"), line
    assert "'s pipeline stages run ppbackward's stage backward (" in line
    assert _report(result)["logging"] == [0, 0, 0]  # no handler left behind, the level NOTSET again
    merged = _python("-m", "ppbackward.run", "--merge-bw", str(probe), cwd=tmp_path)
    assert merged.stderr.splitlines()[0].endswith(", merge_bw on)"), merged.stderr


def test_the_launcher_leaves_the_line_to_a_logging_configuration_in_place(probe, tmp_path):
    """Where the root logger has a handler already, its level decides: WARNING shows nothing, INFO shows it."""
    for level, shown in (("WARNING", False), ("INFO", True)):
        code = (f"import logging, sys, runpy; logging.basicConfig(level=logging.{level}); "
                f"sys.argv = ['ppbackward.run', {str(probe)!r}]; "
                "runpy.run_module('ppbackward.run', run_name='__main__')")
        result = _python("-c", code, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert (f"INFO:ppbackward:{INSTALLED}" in result.stderr) == shown, result.stderr
        assert result.stderr.count(INSTALLED) == int(shown)


def test_merge_bw_installs_with_merge_bw_and_passes_the_targets_own_option_through(probe, tmp_path):
    cwd = probe.parent
    result = _python("-m", "ppbackward.run", "--merge-bw", "-m", "probe_mod", "--merge-bw", cwd=cwd)
    assert result.returncode == 0, result.stderr
    report = _report(result)
    assert (report["installed"], report["merging"], report["argv"][1:]) == (True, True, ["--merge-bw"])


def test_module_runs_as_main_like_python_dash_m(probe, tmp_path):
    cwd = probe.parent
    result = _python("-m", "ppbackward.run", "-m", "probe_mod", "--x", "y", cwd=cwd)
    assert result.returncode == 0, result.stderr
    report = _report(result)
    plain = _report(_python("-m", "probe_mod", "--x", "y", cwd=cwd))
    assert report["argv"] == plain["argv"] == [str(cwd / "probe_mod.py"), "--x", "y"]
    assert report["path0"] == plain["path0"] == str(cwd)
    assert (report["name"], report["installed"], report["swapped"]) == ("__main__", True, True)


@pytest.mark.parametrize("code", ["0", "7"])
def test_exit_code_is_the_targets(probe, tmp_path, code):
    result = _python("-m", "ppbackward.run", str(probe), cwd=tmp_path, env={"PROBE_EXIT": code})
    assert result.returncode == int(code), result.stderr


def test_exception_prints_the_targets_traceback(probe, tmp_path):
    result = _python("-m", "ppbackward.run", str(probe), cwd=tmp_path, env={"PROBE_EXIT": "raise"})
    plain = _python(str(probe), cwd=tmp_path, env={"PROBE_EXIT": "raise"})
    assert result.returncode == plain.returncode == 1
    assert result.stderr.endswith("ValueError: probe failed on purpose\n"), result.stderr
    frames = [line for line in result.stderr.splitlines() if line.lstrip().startswith("File ")]
    assert frames == [line for line in plain.stderr.splitlines() if line.lstrip().startswith("File ")]
    assert "ppbackward/run.py" not in result.stderr and "runpy" not in result.stderr


def test_the_targets_own_excepthook_reports_its_exception(probe, tmp_path):
    result = _python("-m", "ppbackward.run", str(probe), cwd=tmp_path, env={"PROBE_EXIT": "hooked"})
    plain = _python(str(probe), cwd=tmp_path, env={"PROBE_EXIT": "hooked"})
    assert result.returncode == plain.returncode == 1
    hooked = "HOOKED ValueError: probe failed on purpose"
    assert result.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1] == hooked
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "source",
    ["x = (\n",
     "import sys\ndef hook(*args):\n    raise KeyError('hook')\nsys.excepthook = hook\nraise ValueError('v')\n"],
    ids=["syntax-error", "a-hook-that-raises"],
)
def test_a_syntax_error_and_a_raising_excepthook_are_reported_as_python_reports_them(tmp_path, source):
    script = tmp_path / "target.py"
    script.write_text(source)
    result = _python("-m", "ppbackward.run", str(script), cwd=tmp_path)
    plain = _python(str(script), cwd=tmp_path)
    assert result.returncode == plain.returncode == 1
    assert result.stderr.splitlines()[1:] == plain.stderr.splitlines(), result.stderr  # after the install line


@pytest.mark.parametrize("target", [["-m", "no_such_module"], ["-m", "scripts"], ["scripts"]],
                         ids=["no-module", "package-without-main", "folder-without-main"])
def test_a_target_runpy_cannot_find_is_the_interpreters_one_line(probe, tmp_path, target):
    (probe.parent / "__init__.py").write_text("")
    result = _python("-m", "ppbackward.run", *target, cwd=tmp_path)
    plain = _python(*target, cwd=tmp_path)
    assert result.returncode == plain.returncode == 1
    line = result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr, result.stderr
    assert line == plain.stderr.strip(), result.stderr
    if target == ["scripts"]:  # the folder named by its absolute path, as the interpreter names it
        assert line == f"{sys.executable}: can't find '__main__' module in {str(probe.parent)!r}"


def test_a_leading_double_dash_ends_the_launchers_options_as_the_interpreters(probe, tmp_path):
    result = _python("-m", "ppbackward.run", "--", str(probe), "--", "-m", cwd=tmp_path)
    plain = _python("--", str(probe), "--", "-m", cwd=tmp_path)
    assert result.returncode == plain.returncode == 0, result.stderr
    assert _report(result)["argv"] == _report(plain)["argv"] == [str(probe), "--", "-m"]
    assert _report(result)["installed"]


def _launcher_on_torch_2_99(probe: Path) -> str:
    """``python -c`` code running the launcher on ``probe`` with the installed torch reporting a release ppbackward
    does not know (its version check reads ``torch.__version__``)."""
    return ("import sys, runpy, torch; torch.__version__ = '2.99.0'; "
            f"sys.argv = ['ppbackward.run', {str(probe)!r}]; runpy.run_module('ppbackward.run', run_name='__main__')")


def test_unsupported_torch_is_refused_before_the_target_starts(probe, tmp_path):
    code = _launcher_on_torch_2_99(probe)
    result = _python("-c", code, cwd=tmp_path)
    assert result.returncode == 3
    assert result.stdout == ""  # the probe never ran
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"ppbackward.run: not running {probe}: ppbackward does not know the pipelining "
                               "calling contract of torch 2.99.0 (newer than the newest it was tested on, ")
    assert "PPBACKWARD_ALLOW_UNTESTED_TORCH=1" in lines[0], lines[0]  # the line says how to opt in


def test_merge_bw_on_a_torch_without_the_lowering_is_refused_before_the_target_starts(probe, tmp_path):
    # torch 2.5's runtime schedule has no _prepare_schedule_with_comms: removed here to pose as one
    code = ("import sys, runpy; from torch.distributed.pipelining import schedules as s; "
            "del s._PipelineScheduleRuntime._prepare_schedule_with_comms; "
            f"sys.argv = ['ppbackward.run', '--merge-bw', {str(probe)!r}]; "
            "runpy.run_module('ppbackward.run', run_name='__main__')")
    result = _python("-c", code, cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert result.stdout == ""  # the probe never ran
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"ppbackward.run: not running {probe}: merge_bw: torch "), lines[0]
    assert "has no _PipelineScheduleRuntime._prepare_schedule_with_comms; cannot merge B and W" in lines[0]


@pytest.mark.skipif(torch_release() >= (2, 15, 0), reason="this torch's stage.py has the newest known shape")
def test_untested_newer_torch_opt_in_reaches_install(probe, tmp_path):
    # PPBACKWARD_ALLOW_UNTESTED_TORCH reaches install() through the launcher: on this torch 2.13 posing as
    # 2.99 the stage.py shape is not the newest known one's, so the opt-in refuses for that reason
    # (tests/compat/test_compat_newer_torch.py covers the shape that matches)
    code = _launcher_on_torch_2_99(probe)
    result = _python("-c", code, cwd=tmp_path, env={"PPBACKWARD_ALLOW_UNTESTED_TORCH": "1"})
    assert result.returncode == 3
    assert result.stdout == ""  # the probe never ran
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "does not have the shape the newest known contract" in lines[0], lines[0]


@pytest.mark.parametrize(
    "args, message",
    [([], "no target given"), (["-m"], "-m needs a module name"), (["--nope", "x.py"], "unknown option '--nope'"),
     (["missing.py"], "can't open file 'missing.py': no such file"), (["--"], "-- needs a script after it")],
)
def test_bad_usage_is_a_clear_error(tmp_path, args, message):
    result = _python("-m", "ppbackward.run", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"ppbackward.run: {message}"), result.stderr
    assert result.stdout == ""


def test_composes_with_torchrun_every_rank_installs(probe, tmp_path):
    out = tmp_path / "ranks"
    out.mkdir()
    result = _python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                     "-m", "ppbackward.run", str(probe), "--flag", "1", cwd=tmp_path, env={"PROBE_OUT": str(out)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (result.stdout + result.stderr).count(INSTALLED) == 1, result.stderr  # rank 0's line only
    reports = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    for rank, report in reports.items():
        assert report["rank"] == str(rank)
        assert report["argv"] == [str(probe), "--flag", "1"]
        assert (report["name"], report["installed"], report["swapped"]) == ("__main__", True, True)


def test_help_describes_the_launchers_one_option_and_its_exit_codes(capsys):
    from ppbackward.run import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m ppbackward.run [--merge-bw]")
    assert "--merge-bw  install(merge_bw=True)" in out and "3 ppbackward refuses" in out


# A target that uses its __main__ after its body ends (Note [the target stays __main__]): a file opened at module
# level and never closed (flushed when the interpreter clears __main__ at shutdown), a thread that outlives the
# body (it waits for the main thread to finish: an event, no fixed time) and an atexit handler, both pickling a
# class of the target, as an async checkpoint writer and a save at exit do.
LATE_MAIN = textwrap.dedent(
    """
    import atexit, os, pickle, threading
    OUT = os.environ["LATE_OUT"]
    class Ckpt:
        pass
    log = open(os.path.join(OUT, "log.txt"), "w")
    log.write("written, never closed\\n")
    def save(name):
        try:
            pickle.loads(pickle.dumps(Ckpt()))
            result = "pickled"
        except Exception as e:
            result = f"{type(e).__name__}: {e}"
        with open(os.path.join(OUT, name), "w") as f:
            f.write(f"{result}, __file__ {'kept' if '__file__' in globals() else 'deleted'}")
    def writer():
        threading.main_thread().join()
        save("thread.txt")
    threading.Thread(target=writer).start()
    atexit.register(save, "atexit.txt")
    """
)


@pytest.mark.parametrize("kind", ["script", "module", "folder", "zip"])
def test_the_target_stays_main_after_its_body_ends_as_under_the_interpreter(tmp_path, kind):
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "late_main.py").write_text(LATE_MAIN)
    (folder / "app").mkdir()
    (folder / "app" / "__main__.py").write_text(LATE_MAIN)
    with zipfile.ZipFile(folder / "app.zip", "w") as z:
        z.writestr("__main__.py", LATE_MAIN)
    target = {"script": [str(folder / "late_main.py")], "module": ["-m", "late_main"], "folder": ["app"],
              "zip": ["app.zip"]}[kind]
    outs = {}
    for how, args in (("launcher", ["-m", "ppbackward.run", *target]), ("python", target)):
        out = tmp_path / how
        out.mkdir()
        result = _python(*args, cwd=folder, env={"LATE_OUT": str(out)})
        assert result.returncode == 0, result.stderr
        outs[how] = {name: (out / name).read_text() for name in ("log.txt", "thread.txt", "atexit.txt")}
    file = "deleted" if kind == "script" else "kept"  # python deletes a script's __file__ once its body ends
    assert outs["launcher"] == outs["python"] == {
        "log.txt": "written, never closed\n", "thread.txt": f"pickled, __file__ {file}",
        "atexit.txt": f"pickled, __file__ {file}"}


def test_a_script_named_relative_to_the_current_directory_gets_an_absolute_file(tmp_path):
    # python 3.9+ makes __file__ absolute: after a chdir the script's folder and its source are still found
    (tmp_path / "rel.py").write_text(textwrap.dedent(
        """
        import inspect, json, os
        def f():
            return 1
        os.chdir("/")
        print(json.dumps([__file__, os.path.dirname(os.path.abspath(__file__)), inspect.getsource(f)]))
        """
    ))
    result = _python("-m", "ppbackward.run", "rel.py", cwd=tmp_path)
    plain = _python("rel.py", cwd=tmp_path)
    assert result.returncode == plain.returncode == 0, result.stderr
    assert _report(result) == _report(plain) == [str(tmp_path / "rel.py"), str(tmp_path), "def f():\n    return 1\n"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="-P (safe path) is python 3.11+")
def test_safe_path_keeps_the_current_directory_off_sys_path_as_the_interpreters(probe, tmp_path):
    cwd = probe.parent
    result = _python("-P", "-m", "ppbackward.run", "-m", "probe_mod", cwd=cwd)
    plain = _python("-P", "-m", "probe_mod", cwd=cwd)
    assert result.returncode == plain.returncode == 1
    assert result.stderr.splitlines()[-1] == plain.stderr.strip() == f"{sys.executable}: No module named probe_mod"
    result = _python("-P", "-m", "ppbackward.run", str(probe), cwd=tmp_path)
    plain = _python("-P", str(probe), cwd=tmp_path)
    assert result.returncode == plain.returncode == 0, result.stderr
    assert _report(result)["path0"] == _report(plain)["path0"] != str(probe.parent)


def test_a_bad_opt_in_value_on_a_newer_torch_is_a_usage_error_in_one_line(probe, tmp_path):
    code = _launcher_on_torch_2_99(probe)
    result = _python("-c", code, cwd=tmp_path, env={"PPBACKWARD_ALLOW_UNTESTED_TORCH": "yes"})
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""  # the probe never ran
    assert result.stderr.strip().splitlines() == [
        f"ppbackward.run: not running {probe}: PPBACKWARD_ALLOW_UNTESTED_TORCH='yes': expected 1 (opt in), 0 or unset"]


def test_a_path_through_a_symbolic_link_and_dot_dot_runs_the_file_python_runs(tmp_path):
    # python joins the path to the current directory without normalising it: lnk/.. is the link target's parent
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "x.py").write_text("print('real')\n")
    (tmp_path / "x.py").write_text("print('top')\n")
    (tmp_path / "lnk").symlink_to(tmp_path / "real" / "sub")
    result = _python("-m", "ppbackward.run", os.path.join("lnk", "..", "x.py"), cwd=tmp_path)
    plain = _python(os.path.join("lnk", "..", "x.py"), cwd=tmp_path)
    assert result.returncode == plain.returncode == 0, result.stderr
    assert result.stdout == plain.stdout == "real\n"


def test_a_compiled_file_runs_as_python_runs_it(tmp_path):
    import py_compile

    (tmp_path / "c.py").write_text("import sys\nprint('compiled', type(__loader__).__name__)\n")
    pyc = py_compile.compile(str(tmp_path / "c.py"), cfile=str(tmp_path / "c.pyc"))
    result = _python("-m", "ppbackward.run", pyc, cwd=tmp_path)
    plain = _python(pyc, cwd=tmp_path)
    assert result.returncode == plain.returncode == 0, result.stderr
    assert result.stdout == plain.stdout == "compiled SourcelessFileLoader\n"
    (tmp_path / "bad.pyc").write_bytes(b"\0\0\0\0" + Path(pyc).read_bytes()[4:])  # another python's magic
    result = _python("-m", "ppbackward.run", str(tmp_path / "bad.pyc"), cwd=tmp_path)
    plain = _python(str(tmp_path / "bad.pyc"), cwd=tmp_path)
    assert result.returncode == plain.returncode == 1
    bad_magic = "RuntimeError: Bad magic number in .pyc file"
    assert result.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1] == bad_magic
