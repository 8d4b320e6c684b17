#!/usr/bin/env bash
# System packages the test suite needs: Debian's Chromium for the console's browser tests, and a C++
# compiler with Python's headers for the CPU kernels (without them those kernels' tests are skipped).
# PostgreSQL and Redis are expected to be running already (127.0.0.1:5432 and :6379).
set -euo pipefail

PYTHON="${PYTHON:-python3}"
need=()
if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
  need+=(chromium fonts-dejavu-core)
fi
command -v g++ >/dev/null 2>&1 || need+=(g++)
include=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
[ -n "$include" ] && [ ! -f "$include/Python.h" ] && need+=(python3-dev)
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != "0" ] && ! command -v sudo >/dev/null 2>&1; then
  echo "missing system packages (${need[*]}) and this user cannot install them; the tests that need them are skipped" >&2
  exit 0
fi
SUDO=""
[ "$(id -u)" != "0" ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq "${need[@]}" >/dev/null
