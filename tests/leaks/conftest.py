"""The leak tests' temp folder: every test's ``tempfile`` folder (and ``TMPDIR``, for child processes) is
one of pytest's own, so the graph folders a caught leak writes by default (``ppbackward-leaks-*``,
``check_tensor_leaks(output_dir=None)``) are removed with pytest's temp folders, never left in the
system's temp dir (issue 23: 7 were left after ``pytest tests/leaks``)."""

from __future__ import annotations

import tempfile

import pytest


@pytest.fixture(autouse=True)
def _own_tempdir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    folder = str(tmp_path_factory.mktemp("tempdir"))
    monkeypatch.setattr(tempfile, "tempdir", folder)
    monkeypatch.setenv("TMPDIR", folder)
    return folder
