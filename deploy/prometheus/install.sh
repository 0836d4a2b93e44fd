#!/usr/bin/env bash
# Installs prometheus and promtool (Debian's `prometheus` package) unless both are on PATH:
# tests/test_deploy.py checks and unit-tests the rules with promtool and starts a real
# Prometheus on a free port. The package's own service is not needed (the tests start their
# own server).
set -euo pipefail
exec bash "$(dirname "$0")/../apt-install.sh" "prometheus promtool" prometheus
