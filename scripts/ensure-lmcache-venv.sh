#!/usr/bin/env bash
# Build (once) the optional LMCache venv for `make test-lmcache`; print its path.
#
# It is a thin layer over the test venv (scripts/ensure-venv.sh): a `.pth`
# file puts the test venv's site-packages on its path, and only LMCache and the
# few packages it imports that the test venv lacks are installed into it,
# without dependencies (LMCache's own pins would replace the test venv's numpy,
# protobuf and OpenTelemetry). Cached by a hash of this script and of the test
# venv it layers over. kvcompose comes from the checkout (PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."

base=$(readlink -f .venv)
[ -x "$base/bin/python" ] || { echo "no test venv at .venv: run 'make venv' first" >&2; exit 1; }
cache=${KVCOMPOSE_CACHE:-$HOME/.cache/kvcompose}
hash=$( (cat scripts/ensure-lmcache-venv.sh; echo "$base") | sha256sum | cut -c1-12)
venv=$cache/venv-lmcache-$hash

if [ ! -f "$venv/.complete" ]; then
    echo "building LMCache venv $venv over $base (once)" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    "$base/bin/python" -m venv --without-pip "$venv"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    echo "$base_site" > "$site/kvcompose-test-venv.pth"
    "$base/bin/python" -m pip --python "$venv/bin/python" install --quiet --no-deps --no-compile \
        lmcache==0.5.6 aiofile aiofiles caio redis 2> >(grep -v "is ignored: it is neither" >&2)
    touch "$venv/.complete"
fi
echo "$venv"
