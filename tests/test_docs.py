"""The README and ``docs/`` hold together: every link resolves inside the repository
(a file, and a heading where a link names one), nothing points outside it, the README
stays a front door, and its code blocks run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.settings import REPO_ROOT
from tests.conftest import Pipeline

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: Path) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a file's headings."""
    found = set()
    for line in prose(path).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_link_resolves_inside_the_repository(doc: Path) -> None:
    broken = []
    for target in LINK.findall(prose(doc)):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        name, _, anchor = target.partition("#")
        path = (doc.parent / name).resolve() if name else doc
        if REPO_ROOT not in path.parents and path != REPO_ROOT:
            broken.append(f"{target}: outside the repository")
        elif not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no such heading")
    assert broken == []


def test_nothing_in_the_repository_points_outside_it() -> None:
    # Files not yet committed too: a clone holds what is committed now.
    found = subprocess.run(["git", "grep", "--untracked", "-l", "-e", "../shared", "-e",
                            "design card"], cwd=REPO_ROOT, capture_output=True,
                           text=True).stdout.split()
    assert [name for name in found if name != "tests/test_docs.py"] == []


def test_the_readme_is_a_front_door() -> None:
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= 400


def code_blocks(path: Path) -> list[tuple[str, str]]:
    """Each fenced block's language and text."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def test_the_readmes_code_blocks_run(pipeline: Pipeline) -> None:
    """Each block as a reader would run it, against the test session's gateway: the curl
    and Python blocks talk to it, each `pipeline` command is parsed by the command's
    own parser (they start services that run until stopped). Only `make demo` and
    `make test` are left out: they are what runs this."""
    from launch.parser import parser

    def here(text: str) -> str:
        return text.replace("http://127.0.0.1:8000", pipeline.url)

    left_out, ran = [], 0
    for language, text in code_blocks(REPO_ROOT / "README.md"):
        if language == "python":
            done = subprocess.run([sys.executable, "-c", here(text)], capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            ran += 1
            continue
        if language == "text":
            continue  # a drawing
        assert language == "bash", f"a block in {language or 'no language'}"
        for line in text.replace("\\\n", " ").splitlines():
            command = line.split("#", 1)[0].strip()
            if not command:
                continue
            if command.startswith("make "):
                left_out.append(command)
            elif command.startswith("curl "):
                done = subprocess.run(["bash", "-c", here(command) + " --fail --max-time 300"],
                                      capture_output=True, text=True, timeout=320)
                assert done.returncode == 0 and "data: [DONE]" in done.stdout, done.stderr
                ran += 1
            elif command.startswith("pipeline "):
                parser().parse_args(shlex.split(command)[1:])  # exits 2 if it cannot
                ran += 1
            else:
                raise AssertionError(f"a README command this test cannot run: {command}")
    assert left_out == ["make demo", "make test"]
    assert ran >= 8
