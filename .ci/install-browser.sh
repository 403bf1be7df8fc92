#!/usr/bin/env bash
# The browser test's browser: Debian's chromium (apt; root only), driven by playwright (the [test] extra) through
# executable_path: playwright's own browser download is never used (no network but the registries).
# Idempotent. Usage: .ci/install-browser.sh
set -euo pipefail

if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium > /dev/null
  else
    echo "install-browser: chromium is missing and this is not root: run 'sudo apt-get install chromium'," \
      "or tests/test_playground.py's browser tests are skipped (they fail when CI is set)" >&2
  fi
fi

