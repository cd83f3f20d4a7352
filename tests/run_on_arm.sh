#!/usr/bin/env bash
# Runs pytest on an emulated 64-bit Arm (aarch64) Debian, for checking
# vit_jax where no Arm machine is at hand: the CPU attention kernel's real
# build (-mcpu=native, by the Arm g++), its FFI registration in an aarch64
# jaxlib, and whatever tests you name. Slow (qemu runs every instruction):
# the kernel's test file takes ~10 minutes on 2 cores.
#
#   sudo bash tests/run_on_arm.sh [pytest arguments]
#   sudo bash tests/run_on_arm.sh tests/kernels/test_cpu_attention.py  # default
#
# Needs root (debootstrap, chroot, binfmt_misc), Debian's packages and PyPI.
# Makes an arm64 Debian 12 tree in $ARM_ROOT (default /srv/vit_jax_arm64,
# ~1 GB, kept for the next run), installs vit_jax's dependencies there as
# aarch64 wheels (pip --platform, from this machine's pip), copies this
# checkout's tracked files into it, and runs pytest there with -n 0.
# tensorflow-datasets and grain are left out (their imports are lazy).
set -euo pipefail
cd "$(dirname "$0")/.."
root="${ARM_ROOT:-/srv/vit_jax_arm64}"
[ $# -eq 0 ] && set -- tests/kernels/test_cpu_attention.py

for tool in debootstrap qemu-aarch64-static; do
  command -v "$tool" >/dev/null || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap \
      qemu-user-static
    break
  }
done

# aarch64 executables run through qemu; F: the interpreter is opened now,
# so it also serves inside the chroot.
binfmt=/proc/sys/fs/binfmt_misc
mountpoint -q "$binfmt" || mount -t binfmt_misc binfmt_misc "$binfmt"
if [ ! -e "$binfmt/qemu-aarch64" ]; then
  printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F' \
    > "$binfmt/register"
fi

if [ ! -x "$root/usr/bin/python3" ]; then
  # --foreign only unpacks the base system, without running anything of
  # it; the packages asked for are unpacked by hand, with the link that
  # Debian's alternatives would make.
  debootstrap --foreign --arch=arm64 --variant=minbase \
    --include=python3,g++ bookworm "$root"
  for deb in "$root"/var/cache/apt/archives/*.deb; do
    dpkg -x "$deb" "$root"
  done
  ln -sf g++ "$root/usr/bin/c++"
fi

# pyproject.toml's dependencies as CI resolves them, less tensorflow-datasets
# and grain, and less those whose environment marker leaves aarch64 Linux
# out (oneDNN's x86-64 wheel): pip would judge a marker by this x86 host.
mapfile -t requirements < <(python3 -c 'import tomllib
from pip._vendor.packaging.requirements import Requirement
arm = {"platform_machine": "aarch64", "sys_platform": "linux",
       "python_version": "3.11"}
for text in tomllib.load(open("pyproject.toml", "rb"))["project"][
    "dependencies"]:
  requirement = Requirement(text)
  if requirement.marker and not requirement.marker.evaluate(arm):
    continue
  if requirement.name not in ("tensorflow-datasets", "grain"):
    print(requirement)')
python3 -m pip install -q --upgrade --target "$root/opt/site" \
  --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
  --platform manylinux_2_27_aarch64 --platform manylinux_2_28_aarch64 \
  --python-version 3.11 --implementation cp --abi cp311 \
  --only-binary=:all: "${requirements[@]}" tensorboardX pytest pytest-xdist

rm -rf "$root/opt/vit_jax"
mkdir -p "$root/opt/vit_jax" "$root/proc" "$root/sys" "$root/tmp" "$root/root"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$root/opt/vit_jax"

# sysfs too: XNNPACK's cpuinfo (XLA's YNNPACK products) reads the CPU lists
# there, and without them leaves YNNPACK off.
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
mountpoint -q "$root/sys" || mount -t sysfs sysfs "$root/sys"
trap 'umount "$root/proc" "$root/sys"' EXIT
echo "$(uname -m) host, emulated $(chroot "$root" uname -m): pytest $*"
chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/bin:/bin \
  PYTHONPATH=/opt/site:/opt/vit_jax VIT_JAX_CACHE_DIR=/tmp/vit_jax_cache \
  /bin/sh -c 'cd /opt/vit_jax && exec python3 -m pytest -n 0 \
    -p no:cacheprovider -rs "$@"' pytest "$@"
