# Two commands for a fresh machine: `make demo` and `make test`.
.PHONY: test test-compat test-lmcache demo bench venv clean

VENV_PY := .venv/bin/python

venv:
	@scripts/ensure-venv.sh

test: venv
	@scripts/ensure-prometheus.sh
	$(VENV_PY) -m pytest -q

# The connector-API tests and one real-engine test on vLLM 0.30 and 0.31 (own cached venvs).
test-compat:
	@scripts/test-compat.sh

# vLLM's LMCacheConnectorV1 as a kvcompose child (in CI after test-compat; not in `make test`), in its own venv
# (scripts/ensure-lmcache-venv.sh, built once over the test venv) with a test-only CPU copy shim (tests/lmcache).
test-lmcache: venv
	KVCOMPOSE_TEST_LMCACHE=1 PYTHONHASHSEED=0 PYTHONPATH=$(CURDIR) \
		"$$(scripts/ensure-lmcache-venv.sh)/bin/python" -m pytest -q tests/lmcache

# vLLM's server with a CPU offload tier and a disk tier, one prompt stored then loaded, the tiers and a trace (~1 min).
demo: venv
	@$(VENV_PY) examples/demo.py

bench: venv
	$(VENV_PY) -m benchmarks

clean:
	rm -rf .venv .pytest_cache
