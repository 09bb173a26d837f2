#!/usr/bin/env bash
# Make Debian's Chromium available for tests/test_browser.py.
#   present                -> nothing to do
#   root with apt-get      -> install the `chromium` package
#   neither                -> say so plainly; the browser test then skips (fails when CI=true)
# Playwright's own browser download is not used: Playwright drives /usr/bin/chromium.
set -euo pipefail

CHROMIUM=/usr/bin/chromium

if [ -x "$CHROMIUM" ]; then
    exit 0
fi

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: installing Debian's chromium package (for the browser test)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium >/dev/null
    if [ ! -x "$CHROMIUM" ]; then
        echo "ensure_chromium: apt-get installed chromium but $CHROMIUM is missing" >&2
        exit 1
    fi
    echo "ensure_chromium: $("$CHROMIUM" --version 2>/dev/null || echo chromium) installed"
    exit 0
fi

if [ "${CI:-}" = "true" ]; then
    echo "ensure_chromium: $CHROMIUM is missing and cannot be installed here (needs root and apt-get);" \
         "the browser test will fail because CI=true" >&2
    exit 0
fi

echo "ensure_chromium: Chromium cannot be installed here (needs root and apt-get), so the" \
     "browser test will be skipped; to run it, install it with: sudo apt-get install chromium"
exit 0
