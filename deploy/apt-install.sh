#!/usr/bin/env bash
# Usage: apt-install.sh "COMMAND..." PACKAGE...
# Installs the Debian PACKAGEs unless every COMMAND is already on PATH. Runs apt-get as root,
# or through sudo when not root. The install scripts of the tests' real parts (redis-server,
# prometheus, chromium) are this with their commands and packages.
set -euo pipefail
commands=$1
shift
missing=0
for c in $commands; do
    command -v "$c" >/dev/null 2>&1 || missing=1
done
if [ "$missing" -eq 0 ]; then
    exit 0
fi
as_root=(env DEBIAN_FRONTEND=noninteractive)
if [ "$(id -u)" -ne 0 ]; then
    as_root=(sudo -n "${as_root[@]}")
fi
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "$@"
