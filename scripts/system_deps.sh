#!/usr/bin/env bash
# The system packages the tests use, installed where they are missing: with apt-get as root
# (or through sudo), else one line naming what to install. Run by `make test` (system-deps),
# so the README's command alone sets a fresh machine up; the arm64 test's own host tools
# (qemu-user-static, binfmt-support, debootstrap) are installed by scripts/arm64_env.py.
set -uo pipefail

# COMMAND PACKAGE WHAT-NEEDS-IT
WANTED=(
  "promtool prometheus the promtool checks of every process's /metrics"
  "c++ g++ llama-cpp-python, which compiles from source"
)

missing=()
for entry in "${WANTED[@]}"; do
  read -r command package _ <<<"$entry"
  command -v "$command" >/dev/null 2>&1 || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; fi
fi
if ! command -v apt-get >/dev/null 2>&1 || { [ "$(id -u)" -ne 0 ] && [ -z "$sudo" ]; }; then
  echo "make test: install ${missing[*]} (Debian/Ubuntu: sudo apt-get install ${missing[*]}); the tests that need them will fail until then"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "make test: installing ${missing[*]} with apt-get"
if ! $sudo apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; then
  $sudo apt-get update -q >/dev/null 2>&1
  if ! $sudo apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; then
    echo "make test: apt-get could not install ${missing[*]}; the tests that need them will fail"
  fi
fi
exit 0
