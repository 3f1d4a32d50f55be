"""The import rules, checked on every module (imports inside functions too):

    schemas <- pipeline <- {gateway, workers, projections, memory}   apps never import each other
    infra: starting Kafka and PostgreSQL, imports nothing else of ours
    bench: may import anything; only the command (launch) imports it
    launch: the composition root; nothing imports it

and rules across them: only the Kafka adapter (``pipeline/kafka/``) imports
confluent_kafka (tests may: they write records no service would, to see them refused);
every retry's delay comes from ``pipeline.retry.Backoff``, none doubled by hand.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from pipeline.settings import REPO_ROOT

PACKAGES = ("schemas", "pipeline", "gateway", "workers", "projections", "memory", "infra",
            "bench", "launch")
ALLOWED = {
    "schemas": {"schemas"},
    "pipeline": {"schemas", "pipeline"},
    "gateway": {"schemas", "pipeline", "gateway"},
    "workers": {"schemas", "pipeline", "workers"},
    "projections": {"schemas", "pipeline", "projections"},
    "memory": {"schemas", "pipeline", "memory"},
    "infra": {"infra"},
    "bench": set(PACKAGES) - {"launch"},
    "launch": set(PACKAGES),
}


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports (relative imports left out)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def imported_packages(path: Path) -> set[str]:
    return imported_modules(path) & set(PACKAGES)


def test_every_module_keeps_to_its_layer() -> None:
    broken = []
    for package in PACKAGES:
        modules = sorted((REPO_ROOT / package).rglob("*.py"))
        assert modules, package
        for module in modules:
            for imported in sorted(imported_packages(module) - ALLOWED[package]):
                broken.append(f"{module.relative_to(REPO_ROOT)} imports {imported}")
    assert broken == []


def test_only_the_kafka_adapter_imports_confluent_kafka() -> None:
    adapter = REPO_ROOT / "pipeline" / "kafka"
    importers = sorted(
        str(module.relative_to(REPO_ROOT)) for package in PACKAGES
        for module in (REPO_ROOT / package).rglob("*.py")
        if adapter not in module.parents and "confluent_kafka" in imported_modules(module))
    assert importers == []


def test_the_tree_is_the_readmes_layout_table() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    table = readme.split("## Layout", 1)[1]
    listed = {line.split("`")[1].rstrip("/") for line in table.splitlines()
              if line.startswith("| `")}
    # Every folder the repository holds (not what tools make: .venv, .state, egg-info).
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.splitlines()
    folders = {path.split("/", 1)[0] for path in tracked if "/" in path
               and not path.startswith(".")}
    assert listed == folders


def test_every_retry_waits_by_backoff() -> None:
    """Delays doubled by hand drifted apart (no jitter, no reset, their own bounds)."""
    doubled = re.compile(r"min\(\s*(\w+ \* 2|2 \* \w+)\b")
    found = [f"{path.relative_to(REPO_ROOT)}:{n}" for package in PACKAGES
             for path in sorted((REPO_ROOT / package).rglob("*.py"))
             if path != REPO_ROOT / "pipeline" / "retry.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if doubled.search(line)]
    assert found == [], found
