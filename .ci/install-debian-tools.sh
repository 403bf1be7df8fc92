#!/usr/bin/env bash
# Debian tools the tests need, installed with apt where missing (root only):
#   chromium  the browser test's browser, driven by playwright (the [test] extra) through executable_path:
#             playwright's own browser download is never used (no network but the registries);
#   faad      FAAD2, an AAC decoder independent of the FFmpeg (PyAV) that encodes our AAC replies;
#   espeak-ng a speech synthesizer: the realtime tests speak real speech to the server's VAD.
# Idempotent. Usage: .ci/install-debian-tools.sh
set -euo pipefail

missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v faad >/dev/null || missing+=(faad)
command -v espeak-ng >/dev/null || missing+=(espeak-ng)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" > /dev/null
else
  echo "install-debian-tools: missing ${missing[*]} and this is not root: run 'sudo apt-get install ${missing[*]}'" \
    "(without them the browser, AAC and realtime speech tests are skipped locally; they fail when CI is set)" >&2
fi
