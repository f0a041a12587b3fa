# `make run` and `make test` work on a fresh Debian/Ubuntu machine with Python >= 3.10.
VENV     ?= .venv
PY       := $(VENV)/bin/python
SCENARIO ?=
SPEED    ?= 1
LISTEN   ?= 127.0.0.1:9842
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test deps system-deps bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,report]'
	touch $@

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

deps: $(VENV)/.installed system-deps

# A host with the NVIDIA driver runs for real; anywhere else (or with SCENARIO=...) the
# built-in simulated host runs instead.
run: $(VENV)/.installed
	@if [ -z "$(SCENARIO)" ] && ldconfig -p 2>/dev/null | grep -q 'libnvidia-ml\.so\.1'; then \
	  exec $(VENV)/bin/gpu-memory-exporter run --listen $(LISTEN); \
	else \
	  exec $(VENV)/bin/gpu-memory-exporter run --simulate $${SCENARIO:-steady} --speed $(SPEED) --listen $(LISTEN); \
	fi

test: deps
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) bench/sampling.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
