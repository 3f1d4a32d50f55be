"""The import rules, checked on every module (imports inside functions too):

    schemas <- pipeline <- {gateway, workers, projections, memory}   apps never import each other
    infra: starting Kafka and PostgreSQL, imports nothing else of ours
    bench: may import anything; only the command (launch) imports it
    launch: the composition root; nothing imports it

and rules across them: only the Kafka adapter (``pipeline/kafka/``) imports
confluent_kafka (tests may: they write records no service would, to see them refused);
every retry's delay comes from ``pipeline.retry.Backoff``, none doubled by hand; a Kafka
consumer is made as a group's member or as a reader of the log, never as both; content
is sealed by a codec each writer is given, and no service writes it in the clear.

And the size of what a newcomer reads: no module of the services over ``MAX_LINES``, no
constructor taking more than ``MAX_COLLABORATORS``, no module of ``workers/`` importing
the worker itself (its parts see narrow interfaces), and the worker built whole by its
constructor.
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


MAX_LINES = 500
MAX_COLLABORATORS = 8
SERVICES = [package for package in PACKAGES if package != "bench"]


def service_modules() -> list[Path]:
    return [path for package in SERVICES for path in sorted((REPO_ROOT / package).rglob("*.py"))]


def test_no_module_of_the_services_is_longer_than_a_newcomer_reads() -> None:
    over = {str(path.relative_to(REPO_ROOT)) for path in service_modules()
            if len(path.read_text().splitlines()) > MAX_LINES}
    assert over == set(), over


def test_no_constructor_takes_more_than_a_few_collaborators() -> None:
    over = set()
    for path in service_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            for init in node.body:
                if isinstance(init, ast.FunctionDef) and init.name == "__init__":
                    taken = len(init.args.args) - 1 + len(init.args.kwonlyargs)
                    if taken > MAX_COLLABORATORS:
                        over.add(f"{path.relative_to(REPO_ROOT)}:{node.name}")
    assert over == set(), over


def test_no_part_of_the_worker_imports_the_worker() -> None:
    """``Rebalances`` and ``WorkerMetrics`` once read and wrote a dozen of its fields
    (a cycle, hidden behind TYPE_CHECKING)."""
    importers = []
    for path in sorted((REPO_ROOT / "workers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if "workers.worker" in names:
                importers.append(str(path.relative_to(REPO_ROOT)))
    assert importers == []


def test_the_worker_is_built_whole_by_its_constructor() -> None:
    """Its writer, output, runner and consumer were once made in ``run()``, and an
    ``assert self.writer is not None`` stood in for construction in each method."""
    path = REPO_ROOT / "workers" / "worker.py"
    standing_in = [n for n, line in enumerate(path.read_text().splitlines(), 1)
                   if re.search(r"assert self\.\w+ is not None", line)]
    assert standing_in == []


def test_a_consumer_is_a_groups_member_or_a_reader_of_the_log() -> None:
    """One class once held both roles (46 methods): a member that subscribed could be
    asked to read a range, and a reader to commit. Each is made as what it is."""
    adapter = REPO_ROOT / "pipeline" / "kafka"
    made = [f"{path.relative_to(REPO_ROOT)}:{n}" for package in PACKAGES
            for path in sorted((REPO_ROOT / package).rglob("*.py"))
            if adapter not in path.parents
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if re.search(r"\bAsyncConsumer\(", line)]
    assert made == [], made


def test_no_service_writes_content_in_the_clear() -> None:
    """Content once reached the codec through a keyring installed for the whole process:
    a writer that ran where none was installed wrote it in the clear, and nothing said
    so. Each writer is now given its codec, and only benches and tests may write
    content with the codec that holds no keys (``CLEAR``); a producer's ``send`` takes
    only events without content (``pipeline.codec.bare``)."""
    clear = [f"{path.relative_to(REPO_ROOT)}:{n}" for path in service_modules()
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bCLEAR\.encode\(|\bsealing\._?(install|rings)\b", line)]
    assert clear == [], clear
