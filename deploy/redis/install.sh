#!/usr/bin/env bash
# Installs redis-server (the Debian package) unless it is already on PATH: the Batch API's
# tests start their own on a free port. Runs apt-get as root, or through sudo when not root.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
as_root=(env DEBIAN_FRONTEND=noninteractive)
if [ "$(id -u)" -ne 0 ]; then
    as_root=(sudo -n "${as_root[@]}")
fi
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq redis-server
