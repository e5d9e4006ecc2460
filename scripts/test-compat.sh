#!/usr/bin/env bash
# `make test-compat`: kvcompose on the older vLLM releases it supports.
#
# Per release (venvs from scripts/ensure-compat-venvs.sh): the tests that touch
# vLLM's connector API and the connector adapters' contracts (the vLLM classes
# and fields kvcompose reads), then one real-engine test (two ExampleConnector
# children; the repeated prompt loads from the first; tokens equal a plain
# engine's). vLLM 0.32 is the main venv's (`make test`); 0.33 has no CPU build
# and is checked against its API set by tests/test_conformance.py in both.
set -euo pipefail
cd "$(dirname "$0")/.."

unit_tests=(
    tests/test_adapters.py
    tests/test_compat.py
    tests/test_conformance.py
    tests/test_differential.py
    tests/test_fault_injection.py
    tests/test_isolation.py
    tests/test_pairing.py
    tests/test_native_metrics.py
    tests/test_metric_registration.py
    tests/test_vllm_names.py
)
engine_test=tests/test_engine_e2e.py

venvs=$(scripts/ensure-compat-venvs.sh)
mapfile -t lines <<< "$venvs"
for line in "${lines[@]}"; do
    read -r version venv <<< "$line"
    echo "== vLLM $version ($venv)"
    "$venv/bin/python" -m pytest -q -m "not engine" "${unit_tests[@]}"
    "$venv/bin/python" -m pytest -q "$engine_test"
done
