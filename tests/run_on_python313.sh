#!/usr/bin/env bash
# Runs pytest on Python 3.13 with the newest JAX that pyproject.toml admits:
# what `pip install -e ".[test]"` gives a user of a current distribution
# (Debian 13, Ubuntu 24.04 and later), where this machine's Python 3.11 gets
# JAX 0.10 (JAX 0.11 and later need Python 3.12 or newer).
#
#   sudo bash tests/run_on_python313.sh [pytest arguments]   # default suite
#   EXTRAS=test,torch sudo -E bash tests/run_on_python313.sh  # + PyTorch
#   PINS="jax==0.11.2 jaxlib==0.11.2" sudo -E bash tests/run_on_python313.sh
#                                       # an older release in the range
#
# Needs root (debootstrap, chroot, bind mounts), Debian's packages and PyPI.
# Makes a Debian 13 tree in $PY313_ROOT (default /srv/vit_jax_python313,
# ~1 GB, ~5 GB more with torch; kept for the next run), a virtual
# environment there with the project's $EXTRAS (default: test) as pip
# resolves them (then $PINS, pip requirements that replace some of them),
# copies this checkout's tracked files into it and runs pytest there (two
# workers, as `python -m pytest` does here).
set -euo pipefail
cd "$(dirname "$0")/.."
root="${PY313_ROOT:-/srv/vit_jax_python313}"
extras="${EXTRAS:-test}"
pins="${PINS:-}"

command -v debootstrap >/dev/null || {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
}
if [ ! -x "$root/usr/bin/python3.13" ]; then
  echo "Making a Debian 13 tree in $root (debootstrap, about a minute)"
  log="$(mktemp)"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,g++,\
libtcmalloc-minimal4t64,ca-certificates trixie "$root" >"$log" 2>&1 ||
    { tail -20 "$log"; exit 1; }
  rm -f "$log"
fi

# This machine's DNS, its host names (gloo, the CPU collectives of the
# multi-process tests, resolves the host's own) and certificates (a proxy's,
# where there is one), and the Fashion-MNIST files the offline-data tests
# read.
cp /etc/resolv.conf /etc/hosts "$root/etc/"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
mounts=(proc sys dev dev/shm)
if [ -d /usr/share/datasets ]; then
  mkdir -p "$root/usr/share/datasets"
  mounts+=(usr/share/datasets)
fi
for mount in "${mounts[@]}"; do
  mountpoint -q "$root/$mount" || mount --bind "/$mount" "$root/$mount"
done
unmount() {
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    umount "$root/${mounts[i]}" || true
  done
}
trap unmount EXIT

rm -rf "$root/opt/vit_jax"
mkdir -p "$root/opt/vit_jax"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$root/opt/vit_jax"

chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/bin:/bin \
  PIP_DISABLE_PIP_VERSION_CHECK=1 EXTRAS="$extras" PINS="$pins" /bin/bash -c '
  set -e
  [ -x /opt/venv/bin/python ] || python3 -m venv /opt/venv
  . /opt/venv/bin/activate
  cd /opt/vit_jax
  pip install -q --upgrade --upgrade-strategy eager -e ".[$EXTRAS]"
  [ -z "$PINS" ] || pip install -q $PINS
  python -c "import sys, jax, jaxlib, flax
print(\"Python\", sys.version.split()[0], \"jax\", jax.__version__, \"jaxlib\",
      jaxlib.__version__, \"flax\", flax.__version__)"
  exec python -m pytest -p no:cacheprovider -rfEs "$@"' pytest "$@"
