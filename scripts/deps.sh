#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages shardgrad needs, only those missing. Sourced by the
# other scripts; safe to run again.
set -euo pipefail
SG_PACKAGES=(cmake g++ make ccache libeigen3-dev catch2 nlohmann-json3-dev libopenmpi-dev openmpi-bin)
missing=()
for p in "${SG_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "shardgrad: installing missing packages: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
