"""The repository speaks of the product only, and its documentation points at files that exist.

- No text in the tree tells how it was made (work diaries, dated run folders, ticket numbers, notes kept outside
  the repository).
- Every relative path the README and ``docs/*.md`` name, as a markdown link or in backticks, exists in the
  repository.
- The README stays a short page for users.
- ``benchmarks/results/`` holds the latest result of each benchmark, not an archive of runs.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SEARCHED = ("moecc", "cpp", "docs", "README.md", "benchmarks", "tests", "examples")
# Built from pieces, so that this file never matches its own pattern.
NARRATIVE = "|".join((
    "sess" + "ion",
    "host_" + "20[0-9]{2}",
    "accelerator" + " host",
    "DESIGN" + r"\.md",
    "issue" + " #",
    "#" + r"2[0-9]\b",
))
README_MAX_LINES = 220
RESULTS = "benchmarks/results"
RESULTS_MAX_FILES = 40
RESULTS_MAX_FOLDERS = 8
RESULTS_FORBIDDEN = (".patch", ".log", ".sh")
# First components that make a backticked name a repository path even without an extension.
TOP_LEVEL = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".git")}
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", flags=re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
PATH_TOKEN = re.compile(r"^[A-Za-z0-9_.\-][A-Za-z0-9_.\-/]*$")
EXTENSION = re.compile(r"\.[A-Za-z0-9]{1,6}$")
SHELL_FENCES = {"bash", "sh", "shell", "console"}


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def _in_git_checkout() -> bool:
    return shutil.which("git") is not None and _git("rev-parse", "--is-inside-work-tree").stdout.strip() == "true"


def needs_git() -> None:
    if not _in_git_checkout():
        pytest.skip("not a git checkout (or git is not installed): the tree's tracked files are unknown")


def test_no_text_tells_how_the_tree_was_made():
    needs_git()
    found = _git("grep", "-nIE", NARRATIVE, "--", *SEARCHED, f":!{THIS}")
    if found.returncode not in (0, 1):
        pytest.fail(f"git grep failed ({found.returncode}): {found.stderr.strip()}")
    lines = found.stdout.splitlines()
    assert not lines, (f"{len(lines)} lines speak of how the tree was made rather than of the product "
                       f"(pattern {NARRATIVE!r}):\n" + "\n".join(lines[:200]))


def _path_like(token: str) -> bool:
    """Whether a backticked word names a repository path: a relative path with a '/' whose last part has an
    extension (a file), or that starts at a top-level folder of the repository and ends with '/' (a folder).
    Placeholders like ``<family>``, globs, home and absolute paths are not; nor names such as the Trainer's
    ``moecc/tokens_per_s`` log keys."""
    token = token.strip("'\",;:()[]")
    if "/" not in token or not PATH_TOKEN.match(token) or token.startswith(("/", "./", "../")):
        return False
    parts = [part for part in token.split("/") if part]
    if not parts:
        return False
    return bool(EXTENSION.search(parts[-1])) if not token.endswith("/") else parts[0] in TOP_LEVEL


def _named_paths(document: Path) -> list[tuple[str, Path]]:
    """``(as written, where it points)`` for each relative path ``document`` names: markdown links (relative to the
    document), backticked paths in the text and words of shell blocks (relative to the repository's root)."""
    text = document.read_text()
    named: list[tuple[str, Path]] = []
    prose_parts, shell_blocks, last = [], [], 0
    for fence in FENCE.finditer(text):
        prose_parts.append(text[last:fence.start()])
        if fence.group(1).strip().lower() in SHELL_FENCES:
            shell_blocks.append(fence.group(2))
        last = fence.end()
    prose = "".join(prose_parts) + text[last:]
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.\-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor in the same page
        path = target.split("#", 1)[0]
        if path:
            named.append((target, (document.parent / path).resolve()))
    words = [word for span in CODE_SPAN.findall(prose) for word in span.split()]
    words += [word for block in shell_blocks for word in block.split()]
    for word in words:
        if _path_like(word):
            named.append((word.strip("'\",;:()[]"), (ROOT / word.strip("'\",;:()[]")).resolve()))
    return named


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_the_documentation_names_exists(document):
    missing, outside = [], []
    for written, path in _named_paths(document):
        if not path.is_relative_to(ROOT):
            outside.append(written)
        elif not path.exists():
            missing.append(written)
    assert not outside, f"{document.name} points outside the repository: {sorted(set(outside))}"
    assert not missing, f"{document.name} names paths that do not exist: {sorted(set(missing))}"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to {README_MAX_LINES} (details go to docs/)"


def _result_files() -> list[str]:
    """Paths of the files under benchmarks/results, relative to it: git's tracked ones in a checkout, else the
    files on disk."""
    if _in_git_checkout():
        listed = _git("ls-files", "--", RESULTS).stdout.splitlines()
        return [path[len(RESULTS) + 1:] for path in listed]
    base = ROOT / RESULTS
    return [Path(folder, name).relative_to(base).as_posix()
            for folder, _, names in os.walk(base) for name in names]


def test_results_hold_the_latest_result_of_each_benchmark():
    files = _result_files()
    folders = {Path(path).parent.as_posix() for path in files} - {"."}
    folders |= {parent.as_posix() for folder in list(folders) for parent in Path(folder).parents} - {"."}
    forbidden = sorted(path for path in files if path.endswith(RESULTS_FORBIDDEN))
    assert not forbidden, (f"{RESULTS} holds results, not patches, logs or scripts: "
                           f"{len(forbidden)} files, e.g. {forbidden[:20]}")
    assert len(files) <= RESULTS_MAX_FILES, (f"{RESULTS} has {len(files)} files; keep the latest result of each "
                                             f"benchmark, at most {RESULTS_MAX_FILES}")
    assert len(folders) <= RESULTS_MAX_FOLDERS, (f"{RESULTS} has {len(folders)} folders; at most "
                                                 f"{RESULTS_MAX_FOLDERS}: {sorted(folders)[:40]}")
