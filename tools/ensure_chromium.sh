#!/usr/bin/env bash
# Make Debian's Chromium available for tests/test_browser.py.
#   present                -> nothing to do
#   root with apt-get      -> install the `chromium` package
#   neither                -> say so plainly; the browser test then skips (fails when CI=true)
# Playwright's own browser download is not used: Playwright drives /usr/bin/chromium.
# Exits 0 unless an install was possible and failed in CI, so the other tests still run.
set -uo pipefail

CHROMIUM=/usr/bin/chromium
HOW="install it as root with: apt-get install chromium (Debian), then rerun the tests"

cannot_install() {
    if [ "${CI:-}" = "true" ]; then
        echo "ensure_chromium: $1; CI=true, so the browser test will fail" >&2
    else
        echo "ensure_chromium: the browser test will be skipped because $1; to run it, $HOW"
    fi
}

if [ -x "$CHROMIUM" ]; then
    exit 0
fi

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    cannot_install "Chromium cannot be installed here (this needs root and apt-get)"
    exit 0
fi

echo "ensure_chromium: installing Debian's chromium package for the browser test"
export DEBIAN_FRONTEND=noninteractive
if apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null \
        && [ -x "$CHROMIUM" ]; then
    echo "ensure_chromium: $("$CHROMIUM" --version 2>/dev/null || echo chromium) installed"
    exit 0
fi

cannot_install "apt-get could not install chromium (see the messages above)"
if [ "${CI:-}" = "true" ]; then
    exit 1
fi
exit 0
