#!/usr/bin/env bash
# Installs the system packages Orchard's development workspace needs, when they are missing.
# Idempotent; installs nothing when everything is present. Needs root (or sudo) to install.
#   python3 + venv   the workspace interpreter (3.11 or newer)
#   npm              installs buf (protobuf lint) and the Node client's packages from the npm registry
#   nodejs           runs the Node client (clients/node) and its tests
#   gcc, libc6-dev   builds the inagent bundle's static launcher
#   binutils         objdump, which PyInstaller uses to find shared libraries
#   busybox-static   the minimal root filesystem the bundle is tested in
#   unshare          (util-linux) namespaces for sandbox tests
#   umoci, skopeo    build real OCI and docker-archive images offline in the image tests
#   nftables, iproute2  sandbox egress rules (veth pairs, nftables sets)
#   openssl          test certificates for the TLS tests
#   prometheus       a real Prometheus scrapes the services in integration tests; promtool
#                    checks and unit-tests the alerting rules in make charts
#   chromium         the GUI domain's browser, driven by Playwright (never `playwright install`)
set -euo pipefail

missing=()
python3 -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null || missing+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
command -v npm >/dev/null || missing+=(npm)
command -v node >/dev/null || missing+=(nodejs)
command -v gcc >/dev/null || missing+=(gcc)
command -v objdump >/dev/null || missing+=(binutils)
[ -e /usr/lib/x86_64-linux-gnu/libc.a ] || [ -e /usr/lib/aarch64-linux-gnu/libc.a ] || [ -e /usr/lib/libc.a ] || missing+=(libc6-dev)
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "ok installed" || missing+=(busybox-static)
command -v unshare >/dev/null || missing+=(util-linux)
command -v umoci >/dev/null || missing+=(umoci)
command -v skopeo >/dev/null || missing+=(skopeo)
command -v nft >/dev/null || missing+=(nftables)
command -v ip >/dev/null || missing+=(iproute2)
command -v openssl >/dev/null || missing+=(openssl)
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || missing+=(prometheus)
[ -x /usr/bin/chromium ] || missing+=(chromium)

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "setup: installing system packages: ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root to install ${missing[*]}; install them and rerun" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
