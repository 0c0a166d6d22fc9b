"""The docs build from plain Markdown: every relative link resolves, every ``python`` block runs.

Covers ``README.md`` and every ``docs/*.md`` (found when the tests are collected, so a new page is
checked without touching this file):

* every relative link and image points to an existing file, and, when it has a ``#fragment``, to an
  existing heading of that Markdown file (GitHub's slugs: lower case, punctuation dropped, spaces to
  ``-``, ``-1``, ``-2`` ... for repeated headings);
* every fenced block has a language, so whether it runs is explicit: ```` ```python ```` blocks must run
  as-is, fragments and output are fenced ```` ```text ```` or ```` ```bash ````;
* every ```` ```python ```` block runs as-is in a fresh interpreter (``sys.executable``, an empty
  temporary working directory, a timeout): one test per block, with the id ``file:line`` of its
  opening fence (the blocks are started side by side, a few at a time). A block right after a
  ``<!-- torchrun: ARGS | ARGS ... -->`` line is a torchrun script instead: it runs once per ``ARGS``
  as ``torchrun --standalone ARGS-before-"--" block.py ARGS-after-"--"``, in its own process group;
* no page names a feature by ppbackward's issue number ("issue 22", "#20"): a reader gets what the
  feature is; PyTorch's own reports (``pytorch/pytorch#N``, or a bare ``#N`` of five digits or more)
  stay, as does inline code (output quoted as printed);
* ``docs/make_figures.py`` (the command that drew ``docs/images``) still works, and the committed
  pictures are small.

One process per block, CPU; most of the time is importing torch once per block (about 3 s each).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
BLOCK_TIMEOUT_S = 120
MAX_IMAGE_BYTES = 200_000

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


_TORCHRUN = re.compile(r"^<!--\s*torchrun:\s*(.*?)\s*-->\s*$")
TORCHRUN_TIMEOUT_S = 600  # a backstop for a hung launch, not a verdict on speed


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    torchrun: tuple[str, ...] = ()  # one entry per launch: "torchrun args -- script args"

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def _scan(page: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """Fenced blocks, and ``(line number, text)`` of every line outside them."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    fence: tuple[str, int, str] | None = None  # (marker, start line, lang)
    body: list[str] = []
    launches: tuple[str, ...] = ()
    previous = ""
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence = (match.group(1), number, match.group(2).lower())
                body = []
                spec = _TORCHRUN.match(previous)
                launches = tuple(a.strip() for a in spec.group(1).split("|")) if spec else ()
            else:
                prose.append((number, line))
                previous = line
        elif match and match.group(1)[0] == fence[0][0] and len(match.group(1)) >= len(fence[0]) and not match.group(2):
            blocks.append(Block(page, fence[1], fence[2], "\n".join(body) + "\n", launches))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{page.relative_to(ROOT)}:{fence[1]}: code fence never closed"
    return blocks, prose


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = _INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images keep their text
    text = re.sub(r"<[^>]+>", "", text).replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for _, line in _scan(page)[1]:
        match = _HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in _scan(page)[1]:
        text = _INLINE_CODE.sub("code", line)  # `[x](y)` inside code is not a link
        found += [(number, m.group(1)) for m in _LINK.finditer(text)]
        ref = _REF_DEF.match(text)
        if ref:
            found.append((number, ref.group(1)))
    return found


def _link_problem(page: Path, target: str) -> str | None:
    if not target or _EXTERNAL.match(target):
        return None
    path_part, _, fragment = target.partition("#")
    path_part = urllib.parse.unquote(path_part)
    if path_part.startswith("/"):
        return "absolute path: links in the docs must be relative"
    dest = (page.parent / path_part).resolve() if path_part else page
    if not dest.exists():
        return f"no such file: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
    if fragment:
        if dest.suffix != ".md":
            return f"#{fragment} on a file that is not Markdown"
        if urllib.parse.unquote(fragment).lower() not in _anchors(dest):
            return f"no heading with anchor #{fragment} in {dest.relative_to(ROOT)}"
    return None


# "issue 22", "issues 6 and 13", "#20": ppbackward's tracker; PyTorch's numbers have five digits or more
_TRACKER = re.compile(r"\bissues? #?\d+|(?<![\w/#])#\d{1,4}\b", re.IGNORECASE)


def _tracker_mentions(page: Path) -> list[str]:
    """``file:line: text`` of every mention of a ppbackward issue number outside inline code, also one
    that a line break splits ("issue" ending a line, its number opening the next)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    text = [_INLINE_CODE.sub("code", line) for line in lines] + [""]
    return [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for number, line in enumerate(lines, 1)
        if any(m.start() < len(text[number - 1]) for m in _TRACKER.finditer(f"{text[number - 1]} {text[number]}"))
    ]


def _python_blocks() -> list[Block]:
    return [b for page in PAGES for b in _scan(page)[0] if b.lang in ("python", "py", "python3")]


# -- helpers of this file, checked on tiny inputs -------------------------------------------------


@pytest.mark.parametrize(
    "heading, slug",
    [
        ("Memory between B and W", "memory-between-b-and-w"),
        ("Command line: `ppbackward check`", "command-line-ppbackward-check"),
        ("What `ppbackward check` prints", "what-ppbackward-check-prints"),
        ("`stage_backward_weight(weights, param_groups, retain_graph=False)` — W",
         "stage_backward_weightweights-param_groups-retain_graphfalse--w"),
        ("The tracker: `track_activations`", "the-tracker-track_activations"),
    ],
)
def test_slug_matches_github(heading, slug):
    assert _slug(heading) == slug


def test_link_checker_catches_missing_files_and_anchors(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Two words\n\n## Two words\n\n```text\n# not a heading\n```\n")
    assert _anchors(page) == {"title", "two-words", "two-words-1"}
    assert _link_problem(page, "#two-words-1") is None
    assert _link_problem(page, "page.md#title") is None
    assert "no heading" in _link_problem(page, "#not-a-heading")
    assert "no such file" in _link_problem(page, "missing.md")
    assert "absolute path" in _link_problem(page, "/etc/hosts")
    assert _link_problem(page, "https://example.com/x#y") is None
    links = "[a](page.md#title) `[b](nope.md)` ![c](img.png) [d]: ref.md\n"
    page.write_text(links)
    assert [t for _, t in _links(page)] == ["page.md#title", "img.png"]
    page.write_text("[d]: ref.md\n")
    assert [t for _, t in _links(page)] == ["ref.md"]


def test_tracker_mentions_are_found_and_upstream_reports_are_not(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "page.md"
    flagged = ["the split's cost (issue 22)", "## Targets (issues 6 and 13)", "Reported in #20.",
               "```bash\nppbackward bench --split   # Issue 22: the split\n```", "measured after issue\n22's change"]
    kept = ["(pytorch/pytorch#170277)", "output 0 (#170277)", "e.g. `#3 AddmmBackward0 saved`", "issue tracker",
            "[x](a.md#b2)", "6 issues"]
    page.write_text("\n".join(flagged + kept) + "\n")
    assert [m.split(": ", 1)[1] for m in _tracker_mentions(page)] == [
        "the split's cost (issue 22)", "## Targets (issues 6 and 13)", "Reported in #20.",
        "ppbackward bench --split   # Issue 22: the split", "measured after issue",
    ]


# -- the docs themselves ---------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    problems = []
    for number, target in _links(page):
        problem = _link_problem(page, target)
        if problem:
            problems.append(f"{page.relative_to(ROOT)}:{number}: ({target}) {problem}")
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_pages_name_features_not_issue_numbers(page):
    mentions = _tracker_mentions(page)
    assert not mentions, "say what the feature is, not its issue number:\n" + "\n".join(mentions)


# `pip install ppbackward`, `pip install 'ppbackward[plot]'`: ppbackward is not on the package index
_INDEX_INSTALL = re.compile(r"pip install\s+(?:-U\s+)?['\"]?ppbackward\b")


def _index_installs(path: Path) -> list[str]:
    """``file:line: text`` of every line that installs ppbackward from the package index, but the one
    that says it fails."""
    return [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _INDEX_INSTALL.search(line) and "` fails" not in line
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_installs_ppbackward_from_the_package_index(page):
    """A newcomer's try: ``pip install ppbackward`` and ``pip install 'ppbackward[plot]'`` as the README
    wrote them fail; a clone (``pip install -e '.[plot]'``) or a built wheel is the way."""
    found = _index_installs(page)
    assert not found, "ppbackward is not on the package index (README, Install):\n" + "\n".join(found)


def test_no_message_of_the_commands_installs_ppbackward_from_the_package_index():
    found = [hit for path in sorted((ROOT / "src").rglob("*.py")) for hit in _index_installs(path)]
    assert not found, "ppbackward is not on the package index (README, Install):\n" + "\n".join(found)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_fence_says_its_language(page):
    untagged = [b.id for b in _scan(page)[0] if not b.lang]
    assert not untagged, f"fenced blocks without a language (use python, text or bash): {untagged}"


def _torchrun(script: Path, launch: str, folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess | str:
    """``torchrun --standalone <launch before --> script <launch after -->`` in its own process group."""
    torchrun_args, _, script_args = launch.partition(" -- ")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *torchrun_args.split(),
               str(script), *script_args.split()]
    proc = subprocess.Popen(
        command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return f"torchrun {launch}: still running after {TORCHRUN_TIMEOUT_S} s (process group killed)\n{out}"
    return subprocess.CompletedProcess(command, proc.returncode, f"$ torchrun {launch}\n{out}", "")


def _run_block(block: Block, folder: Path) -> subprocess.CompletedProcess | str:
    """Run ``block`` as a script in ``folder`` (once per torchrun launch, if it is a torchrun script);
    the finished process (the first that failed), or a message if it timed out."""
    script = folder / f"{block.page.stem}_{block.line}.py"
    script.write_text(block.code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env["OMP_NUM_THREADS"] = "1"
    if block.torchrun:
        result: subprocess.CompletedProcess | str = ""
        for launch in block.torchrun:
            result = _torchrun(script, launch, folder, env)
            if isinstance(result, str) or result.returncode != 0:
                return result
        return result
    try:
        return subprocess.run(
            [sys.executable, str(script)], cwd=folder, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        return f"still running after {BLOCK_TIMEOUT_S} s (killed)\n{_text(e.stdout)}{_text(e.stderr)}"


def _text(captured: str | bytes | None) -> str:
    """What a timed-out ``subprocess.run(text=True)`` captured (``TimeoutExpired`` may hold bytes)."""
    return captured.decode(errors="replace") if isinstance(captured, bytes) else captured or ""


@pytest.fixture(scope="module")
def block_runs(request, tmp_path_factory):
    """Every selected python block, started at once on a few worker threads (each in its own interpreter
    and temporary folder): the tests below each wait for their own. Most of a block's time is importing
    torch, so running them side by side keeps this file well under a minute. Blocks whose test was
    deselected (``-m "not slow"`` leaves out the torchrun scripts) are not run."""
    selected = {
        item.callspec.params["block"].id
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_python_block_runs"
    }
    blocks = [b for b in _python_blocks() if b.id in selected]
    workers = max(2, min(len(blocks), os.cpu_count() or 2))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        yield {b.id: pool.submit(_run_block, b, tmp_path_factory.mktemp("block")) for b in blocks}


@pytest.mark.parametrize(
    "block", [pytest.param(b, id=b.id, marks=(pytest.mark.slow,) if b.torchrun else ()) for b in _python_blocks()]
)
def test_python_block_runs(block, block_runs):
    proc = block_runs[block.id].result()
    if isinstance(proc, str):
        pytest.fail(f"{block.id}: {proc}")
    assert proc.returncode == 0, (
        f"{block.id}: the python block failed (exit code {proc.returncode}); fence it as ```text if it is "
        f"not meant to run\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )


def test_make_figures_command_works_and_images_are_small(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "make_figures.py"), "--out", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    have_dot = shutil.which("dot") is not None
    assert proc.returncode == (0 if have_dot else 1), proc.stdout + proc.stderr
    assert proc.stdout.count("same step with ppbackward: no tensor and no autograd node leaked") == 2, proc.stdout
    made = sorted(p.name for p in tmp_path.iterdir())
    committed = sorted(p.name for p in (ROOT / "docs" / "images").iterdir())
    assert set(made) <= set(committed), f"make_figures.py writes {made}, docs/images has {committed}"
    assert {n for n in committed if n.endswith(".dot")} == {n for n in made if n.endswith(".dot")}
    for name in committed:
        size = (ROOT / "docs" / "images" / name).stat().st_size
        assert size < MAX_IMAGE_BYTES, f"docs/images/{name} is {size} bytes (keep pictures < 200 KB)"


def test_only_contributing_says_how_long_the_check_takes():
    """A newcomer found the default check's idle time given as 90, 103 and 113 s on three pages. The dated
    timing table of CONTRIBUTING.md is the one place; the README and the docs link to it (a quoted run's
    own output aside)."""
    figures = re.compile(r"\b\d+(?:\.\d+)? s on 2 idle cores|the check alone \d+ s")
    said = [f"{page.relative_to(ROOT)}: {m.group(0)}" for page in PAGES
            for m in figures.finditer(" ".join(" ".join(text.split()) for _, text in _scan(page)[1]))]
    assert not said, "link to CONTRIBUTING.md's timing table instead:\n" + "\n".join(said)
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert re.search(r"the check alone \d+ s, PASS \d+/\d+ \(\d{4}-\d\d-\d\d, ", contributing)  # one figure, dated
    assert "## How long the commands take" in contributing
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "prints a table per scenario" in readme and "prints one table" not in readme


# The front door and the performance page stay short (a user's issue: the README read like a lab notebook,
# `ppbackward.install()` first appeared at its line 51, docs/performance.md was 923 lines of dated runs).
README_MAX_LINES = 150
README_USE_BY_LINE = 40
PERFORMANCE_MAX_LINES = 250
CHANGELOG_MAX_LINE = 300


def _size_problems(readme: str, performance: str, changelog: str) -> list[str]:
    """What breaks the size rules: README.md at most 150 lines, with ``ppbackward.install()`` and
    ``python -m ppbackward.run`` within its first 40; docs/performance.md at most 250 lines; no CHANGELOG
    line over 300 characters (a release note is one line per change; details live in the docs)."""
    problems = []
    lines = readme.splitlines()
    if len(lines) > README_MAX_LINES:
        problems.append(f"README.md has {len(lines)} lines (at most {README_MAX_LINES})")
    head = "\n".join(lines[:README_USE_BY_LINE])
    for use in ("ppbackward.install()", "python -m ppbackward.run"):
        if use not in head:
            problems.append(f"README.md does not show `{use}` within its first {README_USE_BY_LINE} lines")
    n = len(performance.splitlines())
    if n > PERFORMANCE_MAX_LINES:
        problems.append(f"docs/performance.md has {n} lines (at most {PERFORMANCE_MAX_LINES}; dated runs go to "
                        "benchmarks/RESULTS.md)")
    problems += [f"CHANGELOG.md:{i}: {len(line)} characters (at most {CHANGELOG_MAX_LINE})"
                 for i, line in enumerate(changelog.splitlines(), 1) if len(line) > CHANGELOG_MAX_LINE]
    return problems


def test_size_rules_catch_a_long_readme_a_late_install_a_long_performance_page_and_a_long_changelog_line():
    ok_readme = "# x\n\n`ppbackward.install()` and `python -m ppbackward.run`\n"
    assert _size_problems(ok_readme, "p\n" * 250, "c" * 300 + "\n") == []
    found = _size_problems("x\n" * 151, "p\n" * 251, "- " + "c" * 299 + "\n")
    assert [p.split(" ")[0] for p in found] == ["README.md", "README.md", "README.md", "docs/performance.md",
                                                "CHANGELOG.md:1:"], found
    late = "x\n" * 40 + "`ppbackward.install()` `python -m ppbackward.run`\n"
    assert len(_size_problems(late, "", "")) == 2


def test_readme_performance_page_and_changelog_are_short():
    problems = _size_problems((ROOT / "README.md").read_text(encoding="utf-8"),
                              (ROOT / "docs" / "performance.md").read_text(encoding="utf-8"),
                              (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_the_readme_states_the_rank_count_of_every_default_scenario():
    """Issue 23: the README said check runs "2 ranks" though the ddp scenario runs 4."""
    from ppbackward._tools.harness.scenarios import DEFAULT, SCENARIOS

    readme = " ".join((ROOT / "README.md").read_text().split())
    said = readme.split("`ppbackward check` runs every schedule", 1)[1].split(". ", 1)[0]
    for n in sorted({SCENARIOS[name].nproc for name in DEFAULT}):
        assert f"{n} ranks" in said or f"{n} for" in said, (n, said)
    bigger = [name for name in DEFAULT if SCENARIOS[name].nproc > 2]
    assert all(f"{name} scenario" in said for name in bigger), (bigger, said)
