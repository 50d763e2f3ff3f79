#!/usr/bin/env bash
# Installs Debian's chromium for the browser test of the page at / (tests/e2e/test_playground_browser.py)
# when it is missing and apt-get can be used (as root, or through sudo without a password).
# Never fails its caller: when it cannot install, it says why and the test skips with the reason.
set -u

for name in chromium chromium-browser google-chrome google-chrome-stable; do
  if command -v "$name" >/dev/null 2>&1; then
    exit 0
  fi
done

say() { echo "install-browser.sh: $*; the browser test will be skipped" >&2; }

if ! command -v apt-get >/dev/null 2>&1; then
  say "no chromium and no apt-get to install it (install chromium yourself)"
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  say "no chromium, and apt-get needs root (run: sudo apt-get install chromium)"
  exit 0
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
apt_install() {
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
    -o DPkg::Lock::Timeout=120 chromium >>"$log" 2>&1
}
# package lists may be missing or stale (as in a fresh container): refresh them only then
if ! apt_install; then
  if ! { "${sudo[@]}" apt-get update -qq >>"$log" 2>&1 && apt_install; }; then
    say "apt-get could not install chromium: $(tail -n 3 "$log" | tr '\n' ' ')"
    exit 0
  fi
fi
echo "install-browser.sh: installed $(chromium --version 2>/dev/null || echo chromium)"
