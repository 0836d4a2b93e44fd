#!/usr/bin/env bash
# Installs Chromium and its WebDriver (the Debian packages chromium and chromium-driver) unless
# both are already on PATH: the /admin page's test drives them with Selenium.
set -euo pipefail
exec bash "$(dirname "$0")/../deploy/apt-install.sh" "chromium chromedriver" chromium chromium-driver
