#!/usr/bin/env bash
# Installs Chromium and its WebDriver (the Debian packages chromium and chromium-driver) unless
# both are already on PATH: the /admin page's test drives them with Selenium. Runs apt-get as
# root, or through sudo when not root.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
as_root=(env DEBIAN_FRONTEND=noninteractive)
if [ "$(id -u)" -ne 0 ]; then
    as_root=(sudo -n "${as_root[@]}")
fi
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends chromium chromium-driver
