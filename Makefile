# `make run` and `make test` work on a fresh Debian/Ubuntu machine with Python >= 3.10.
VENV     ?= .venv
PY       := $(VENV)/bin/python
SCENARIO ?=
SPEED    ?= 1
LISTEN   ?= 127.0.0.1:9842
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test lint deps system-deps bench clean

# pip's output (build back-end notices included) is shown only when it fails.
PIP      = $(VENV)/bin/pip install -q
LOGGED   = > $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }

# The daemon (with the `report` extra, so `analyze --report` draws its plots) for `make run`;
# the test and lint tools on top for `make test`.
$(VENV)/.installed: pyproject.toml
	@echo "creating $(VENV) and installing gpu-memory-exporter (first run only, ~30 s)..."
	@python3 -m venv $(VENV)
	@$(PIP) --upgrade pip $(LOGGED)
	@$(PIP) -e '.[report]' $(LOGGED)
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	@echo "installing the test and lint tools into $(VENV) (first run only, ~20 s)..."
	@$(PIP) -e '.[test,report]' $(LOGGED)
	@touch $@

# The integration tests run the real promtool, prometheus, alertmanager and amtool binaries,
# and render the Kubernetes manifests with kubectl kustomize.
system-deps:
	@if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null \
	    || ! command -v amtool >/dev/null || ! command -v openssl >/dev/null \
	    || ! command -v kubectl >/dev/null; then \
	  echo "installing prometheus, prometheus-alertmanager, openssl and kubectl (Debian packages)"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    prometheus prometheus-alertmanager openssl kubectl >/dev/null; \
	fi

deps: $(VENV)/.installed-test system-deps

# A host with the NVIDIA driver runs for real; anywhere else (or with SCENARIO=...) the
# built-in simulated host runs instead.
run: $(VENV)/.installed
	@if [ -z "$(SCENARIO)" ] && ldconfig -p 2>/dev/null | grep -q 'libnvidia-ml\.so\.1'; then \
	  echo "NVIDIA driver found: sampling this host's GPUs; status page http://$(LISTEN)/, metrics /metrics"; \
	  exec $(VENV)/bin/gpu-memory-exporter run --listen $(LISTEN); \
	else \
	  [ -n "$(SCENARIO)" ] || echo "no NVIDIA driver here: running a simulated host instead"; \
	  echo "simulated host, scenario '$${SCENARIO:-steady}' at $(SPEED)x; status page http://$(LISTEN)/, metrics /metrics" \
	    "(make run SCENARIO=leak SPEED=60 for another; $(VENV)/bin/gpu-memory-exporter scenarios lists them)"; \
	  exec $(VENV)/bin/gpu-memory-exporter run --simulate $${SCENARIO:-steady} --speed $(SPEED) --listen $(LISTEN); \
	fi

# Every check runs, so one report shows all that fails.
lint: $(VENV)/.installed-test
	@status=0; for check in "ruff check ." "mypy" "hadolint Dockerfile"; do \
	  echo "== $$check"; $(VENV)/bin/$$check || status=1; \
	done; exit $$status

test: deps lint
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) bench/sampling.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache *.egg-info build dist
