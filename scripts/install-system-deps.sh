#!/usr/bin/env bash
# System packages the test suite needs: Debian's Chromium for the console's browser tests.
# PostgreSQL and Redis are expected to be running already (127.0.0.1:5432 and :6379).
set -euo pipefail

if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" != "0" ] && ! command -v sudo >/dev/null 2>&1; then
  echo "chromium is missing and this user cannot install it; browser tests will be skipped" >&2
  exit 0
fi
SUDO=""
[ "$(id -u)" != "0" ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
