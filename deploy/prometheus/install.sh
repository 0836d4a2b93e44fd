#!/usr/bin/env bash
# Installs prometheus and promtool (Debian's `prometheus` package) unless both are on PATH:
# tests/test_deploy.py checks and unit-tests the rules with promtool and starts a real
# Prometheus on a free port. Runs apt-get as root, or through sudo when not root. The
# package's own service is not needed (the tests start their own server).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
as_root=(env DEBIAN_FRONTEND=noninteractive)
if [ "$(id -u)" -ne 0 ]; then
    as_root=(sudo -n "${as_root[@]}")
fi
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends prometheus
