#!/usr/bin/env bash
# Builds csrc/ with -Wall -Wextra -Werror for aarch64 and armhf (Debian's cross compilers)
# and runs the C unit tests (tests/c/test_core.c) under qemu-user; natively too.
# The portable C99 GEMM is used (no BLAS), as on an armv7 board. Installs the toolchains with
# apt-get when they are missing and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."

targets=(native aarch64-linux-gnu arm-linux-gnueabihf)
missing=()
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu)
command -v arm-linux-gnueabihf-gcc >/dev/null || missing+=(gcc-arm-linux-gnueabihf)
{ command -v qemu-aarch64 >/dev/null && command -v qemu-arm >/dev/null; } || missing+=(qemu-user)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    else
        echo "check_arm: missing ${missing[*]} (apt-get install them)" >&2
        exit 2
    fi
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags=(-std=c99 -O2 -Wall -Wextra -Werror -Icsrc)
status=0
for t in "${targets[@]}"; do
    if [ "$t" = native ]; then cc=gcc; run=(); extra=(); else cc=$t-gcc; extra=(-static); fi
    case "$t" in
        aarch64-linux-gnu) run=(qemu-aarch64) ;;
        arm-linux-gnueabihf) run=(qemu-arm); extra+=(-mfpu=neon) ;;
    esac
    echo "== $t: $cc"
    "$cc" "${flags[@]}" "${extra[@]}" csrc/*.c tests/c/test_core.c -lm -o "$out/test_core_$t"
    if ! "${run[@]}" "$out/test_core_$t"; then status=1; fi
done
exit $status
