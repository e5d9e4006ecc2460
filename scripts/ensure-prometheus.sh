#!/usr/bin/env bash
# Install the Prometheus server and promtool from Debian if they are missing.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    exit 0
fi
echo "installing prometheus (Debian package) for the metrics tests" >&2
export DEBIAN_FRONTEND=noninteractive
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo apt-get install -y -qq prometheus >/dev/null 2>&1 || {
    $sudo apt-get update -qq >/dev/null
    $sudo apt-get install -y -qq prometheus >/dev/null
}
# The package starts no daemon inside containers; stop one if it did.
$sudo systemctl stop prometheus >/dev/null 2>&1 || true
