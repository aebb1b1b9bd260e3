#!/usr/bin/env bash
# Debian's chromium and the Playwright Python driver for the review UI's browser test
# (tests/review/test_review_browser.py). Playwright's own browser download is not used.
set -euo pipefail
if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
python3 -m pip install -q playwright
