"""Run inside an image: import every module of the pipeline's packages and print, as
JSON, the ones that fail and why. The deploy test (tests/test_images.py) holds each image
to the modules its entry points need."""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys

PACKAGES = ["schemas", "pipeline", "gateway", "workers", "projections", "memory", "infra",
            "launch", "bench"]


def main() -> int:
    failures: dict[str, str] = {}
    modules: list[str] = []
    for name in PACKAGES:
        try:
            package = importlib.import_module(name)
        except Exception as exc:  # a package that does not import fails with its modules
            failures[name] = f"{type(exc).__name__}: {exc}"
            continue
        modules.append(name)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            modules.append(info.name)
            try:
                importlib.import_module(info.name)
            except Exception as exc:
                failures[info.name] = f"{type(exc).__name__}: {exc}"
    json.dump({"modules": modules, "failures": failures}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
