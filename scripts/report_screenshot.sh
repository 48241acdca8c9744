#!/usr/bin/env bash
# Renders a `shardgrad bench` page (bench_results.html) in headless Chromium and saves a PNG, to see that the
# report draws in a real browser. Installs the distribution's chromium when it is missing (not in
# CI: only this script needs it).
#   bash scripts/report_screenshot.sh report.html [report.png] [width] [height]
set -euo pipefail
html=${1:?usage: report_screenshot.sh REPORT.html [OUT.png] [WIDTH] [HEIGHT]}
png=${2:-${html%.html}.png}
width=${3:-1200}
height=${4:-3000}
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  echo "report_screenshot: installing chromium"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
  browser=$(command -v chromium || command -v chromium-browser)
fi
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size="$width,$height" \
  --screenshot="$(realpath -m "$png")" "file://$(realpath "$html")" 2>/dev/null
test -s "$png"
echo "wrote $png"
