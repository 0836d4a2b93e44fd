#!/usr/bin/env bash
# Installs redis-server (the Debian package) unless it is already on PATH: the Batch API's
# tests start their own on a free port.
set -euo pipefail
exec bash "$(dirname "$0")/../apt-install.sh" "redis-server" redis-server
