"""``ppbackward bench --help`` names features, not the tracker's issue numbers, and its options stay
those of the parser before its options were split feature by feature (same names, same order)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from ppbackward._tools.cli.bench import _parser, main


def _help() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    return out.getvalue()


def test_help_names_no_issue_number():
    text = _help()
    assert not re.search(r"\bissues? #?\d+|(?<![\w/#])#\d{1,4}\b", text, re.IGNORECASE), text
    assert "--split only the cost of splitting the backward: B, W, B+W" in " ".join(text.split())


def test_split_help_names_the_configurations_split_runs():
    """A newcomer's ``bench --split`` ran six configurations where its help said four."""
    from ppbackward._tools.bench.split import CONFIGS

    text = " ".join(_help().split())
    assert len(CONFIGS) == 6 and "(default here: six, from host" in text
    assert ": " + ",".join(c.name for c in CONFIGS) + ";" in text


def test_options_in_their_order():
    flags = [a.option_strings[-1] for a in _parser()._actions]
    assert flags == [
        "--help", "--configs", "--repeats", "--budget", "--json", "--quick", "--schedule", "--schedule-repeats",
        "--schedule-timeout", "--split", "--one-rank-step", "--device", "--schedule-d-model", "--compile",
        "--compile-backend", "--trace", "--plot", "--no-scaling", "--no-profile", "--profile-config",
    ]
