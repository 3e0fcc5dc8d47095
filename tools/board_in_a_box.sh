#!/usr/bin/env bash
# A board in a box: a Debian bookworm arm64 userland on this x86-64 machine, edgefl installed
# into it the way docs/deployment.md tells a board owner to, and real runs whose clients are
# aarch64 processes (qemu-user).
#
#   tools/board_in_a_box.sh              all of it: userland, install, info, fleet (full)
#   tools/board_in_a_box.sh userland     build (or reuse) the cached arm64 userland
#   tools/board_in_a_box.sh install      a fresh /opt/edgefl/venv with this checkout in it
#   tools/board_in_a_box.sh info         `edgefl info` under qemu (backend c, blas yes)
#   tools/board_in_a_box.sh fleet        tests/test_board.py, the long variant
#   tools/board_in_a_box.sh run [-b DIR]... -- CMD ARGS   CMD inside the box (DIR bound in)
#   tools/board_in_a_box.sh path         print the box's directory
#
# How aarch64 programs run here without binfmt on the host: every command in the box runs in
# its own user and mount namespace, where binfmt_misc is mounted afresh (Linux >= 6.7 gives a
# user namespace its own instance) and qemu-aarch64-static registered with the F flag. So a
# program in the box may exec another aarch64 program (pip's build subprocesses, gcc's cc1,
# venv's ensurepip), exactly as on a board, and nothing changes for the rest of the machine.
# The namespace is chrooted into the userland with /dev, /proc and /sys bound in; the network
# is the host's, so a broker on 127.0.0.1 is the board's gateway.
#
# Environment:
#   EDGEFL_BOARD_CACHE   where boxes are kept (default ${XDG_CACHE_HOME:-~/.cache}/edgefl)
#   EDGEFL_BOARD_CC      board: the userland's own gcc under qemu;
#                        cross (default): Debian's gcc-aarch64-linux-gnu running natively,
#                        against the board's own headers and libraries (measured faster,
#                        docs/deployment.md "A board in a box")
#   EDGEFL_BOARD_CPU     the CPU qemu emulates (default cortex-a72, a Raspberry Pi 4's)
#   EDGEFL_BOARD_FRESH   1: install makes its venv from nothing instead of the kept venv with
#                        edgefl's dependencies (deps_venv)
#   EDGEFL_BOARD_MIRROR  Debian mirror (default: the first one apt uses here)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)

SUITE=bookworm
ARCH=arm64
QEMU_ARCH=aarch64
# the board's packages: Python from Debian, venv, and step 1 of docs/deployment.md
# (python3-dev and gcc for the C core); ca-certificates for pip's TLS
PACKAGES=python3,python3-venv,python3-pip,python3-dev,gcc,libc6-dev,ca-certificates
MIRROR=${EDGEFL_BOARD_MIRROR:-$(awk '/^URIs:/ {print $2; exit} /^deb / {print $2; exit}' \
    /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | head -1)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CACHE=${EDGEFL_BOARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgefl}
KEY=$(printf '%s\n' "$SUITE" "$ARCH" "$PACKAGES" | sha256sum | cut -c1-12)
BOX=$CACHE/board-$ARCH-$KEY
VENV=/opt/edgefl/venv
CC_MODE=${EDGEFL_BOARD_CC:-cross}
# the emulated CPU: a Raspberry Pi 4's. qemu's default ("max", Armv9 with SVE and SME) makes
# OpenBLAS 0.3.34 choose its armv9sme kernels, and under qemu 7.2 the GEMMs they compute are
# wrong (a run that reaches 0.75 accuracy on x86-64 stays at 0.15); on a Cortex-A72 OpenBLAS
# takes its cortexa57 kernels, as on the board
QEMU_CPU=${EDGEFL_BOARD_CPU:-cortex-a72}
# the magic of an aarch64 ELF executable or shared object (qemu's scripts/qemu-binfmt-conf.sh)
BINFMT=':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F'

say() { printf '== board: %s\n' "$*" >&2; }
die() { printf 'board_in_a_box: %s\n' "$*" >&2; exit 2; }

need_tools() {
    local missing=()
    command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    if [ "$CC_MODE" = cross ]; then
        command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu)
    fi
    if [ ${#missing[@]} -gt 0 ]; then
        [ "$(id -u)" = 0 ] || die "missing ${missing[*]} (apt-get install them)"
        say "apt-get install ${missing[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    fi
}

# box_run [-b DIR]... [-e VAR=VALUE]... -- CMD ARGS: CMD in the chrooted userland, as pid of
# this process (exec all the way down: a signal sent to it reaches CMD)
box_run() {
    local binds=() envs=() cross=
    while [ $# -gt 0 ]; do
        case "$1" in
            -b) binds+=("$2"); shift 2 ;;
            -e) envs+=("$2"); shift 2 ;;
            -x) cross=1; shift ;;
            --) shift; break ;;
            *) break ;;
        esac
    done
    [ -e "$BOX/.userland-ok" ] || die "no userland at $BOX: run tools/board_in_a_box.sh userland"
    [ -e "$BOX/.cpuinfo" ] || write_cpuinfo
    local inner='
set -e
box=$1; shift
mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
printf "%s" "$BOARD_BINFMT" > /proc/sys/fs/binfmt_misc/register
mount --rbind /dev "$box/dev"
mount --rbind /proc "$box/proc"
mount --rbind /sys "$box/sys"
mount --bind "$box/.cpuinfo" "$box/proc/cpuinfo"
mount -t tmpfs -o mode=1777 tmpfs "$box/tmp"
mkdir -p "$box/run/host-cross"
if [ -n "$BOARD_CROSS" ]; then
    # the host root for the cross gcc (tools/board_in_a_box.sh cc_env); its cc1, as and ld
    # are x86-64 programs whose loader the kernel looks for at /lib64 in the chroot; and
    # it finds its own libc.so first, a linker script naming /usr/aarch64-linux-gnu/lib/...
    # (the same glibc 2.36 as the board). Mounted for this namespace only: the board
    # must not see an /usr/aarch64-linux-gnu/bin/as with its own gcc
    mount --rbind / "$box/run/host-cross"
    mkdir -p "$box/lib64" "$box/usr/aarch64-linux-gnu"
    mount --bind /usr/lib/x86_64-linux-gnu "$box/lib64"
    mount --bind /usr/aarch64-linux-gnu "$box/usr/aarch64-linux-gnu"
fi
while [ "$1" != "--" ]; do
    mkdir -p "$box$1"; mount --bind "$1" "$box$1"; shift
done
shift
exec chroot "$box" /usr/bin/env -i "$@"'
    local bind_args=()
    for b in "${binds[@]}"; do bind_args+=("$(cd "$b" && pwd -P)"); done
    BOARD_BINFMT=$BINFMT BOARD_CROSS=$cross exec unshare --user --map-root-user --mount --propagation private \
        /bin/sh -c "$inner" box "$BOX" "${bind_args[@]}" -- \
        PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 QEMU_CPU="$QEMU_CPU" \
        PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
        PIP_DEFAULT_TIMEOUT=180 "${envs[@]}" "$@"
}

# qemu-user 7.2 shows an aarch64 program the host's x86 /proc/cpuinfo, and onnxruntime's
# CPU detection (cpuinfo) dies of SIGSEGV parsing it, in `import onnxruntime`. The box shows
# a Raspberry Pi 4's instead (Cortex-A72: implementer 0x41, part 0xd08), one entry per host
# CPU so thread counts stay the host's.
write_cpuinfo() {
    local n i
    n=$(nproc)
    for ((i = 0; i < n; i++)); do
        printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\n' "$i"
        printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\nCPU revision\t: 3\n\n'
    done >"$BOX/.cpuinfo"
    printf 'Hardware\t: BCM2835\nRevision\t: c03111\nModel\t\t: Raspberry Pi 4 Model B Rev 1.1\n' >>"$BOX/.cpuinfo"
}

build_userland() {
    if [ -e "$BOX/.userland-ok" ]; then
        say "userland cached: $BOX"
        return
    fi
    need_tools
    local t0=$SECONDS tmp="$BOX.partial"
    rm -rf "$tmp"
    mkdir -p "$CACHE"
    say "debootstrap --foreign $SUITE $ARCH ($PACKAGES) from $MIRROR"
    debootstrap --foreign --arch=$ARCH --variant=minbase --include=$PACKAGES \
        $SUITE "$tmp" "$MIRROR" >"$CACHE/debootstrap-$KEY.log" 2>&1 ||
        { tail -20 "$CACHE/debootstrap-$KEY.log" >&2; die "debootstrap failed"; }
    # debootstrap's second stage would run the maintainer scripts under the target's dpkg,
    # which needs binfmt on the host; unpacking every downloaded package gives the files,
    # and the few things postinst scripts would make are made below
    say "unpacking $(wc -l <"$tmp/debootstrap/debpaths") packages"
    while read -r _ deb; do
        dpkg-deb --fsys-tarfile "$tmp/$deb" | tar -x --keep-directory-symlink -C "$tmp"
    done <"$tmp/debootstrap/debpaths"
    rm -f "$tmp/proc"; mkdir -p "$tmp/proc" "$tmp/sys" "$tmp/dev" "$tmp/run/host-cross"
    # update-ca-certificates' output, the resolver, and the same index pip uses on this host
    cp /etc/ssl/certs/ca-certificates.crt "$tmp/etc/ssl/certs/ca-certificates.crt"
    cp -L /etc/resolv.conf "$tmp/etc/resolv.conf"
    rm -rf "$tmp/var/cache/apt/archives/"*.deb
    touch "$tmp/.userland-ok"
    rm -rf "$BOX" && mv "$tmp" "$BOX"
    (box_run -- /usr/bin/python3 -c 'import platform, sys; print("userland python", sys.version.split()[0], platform.machine())' \
        ) || die "the userland's python does not start under qemu"
    say "userland built in $((SECONDS - t0)) s: $BOX ($(du -sh "$BOX" | cut -f1))"
}

# the compiler the C core is built with (setup.py via setuptools, which honours CC/LDSHARED):
# fills CC_ARGS with box_run's -e options
CC_ARGS=()
cc_env() {
    case "$CC_MODE" in
        board) CC_ARGS=() ;;   # sysconfig's aarch64-linux-gnu-gcc: the userland's gcc, under qemu
        cross)
            # Debian's cross gcc from the host (bound at /run/host-cross), run through the
            # host's own dynamic loader; --sysroot=/ makes it use the board's headers and libs
            local wrap=/usr/local/bin/edgefl-cross-gcc
            mkdir -p "$BOX/usr/local/bin"
            local old
            for old in "$BOX/lib64" "$BOX/usr/aarch64-linux-gnu"; do   # an earlier version's links
                if [ -L "$old" ]; then rm -f "$old"; fi
            done
            cat >"$BOX$wrap" <<'EOF'
#!/bin/sh
# the host's x86-64 aarch64-linux-gnu-gcc, natively, with the board's / as its sysroot
H=/run/host-cross
export LD_LIBRARY_PATH=$H/usr/lib/x86_64-linux-gnu:$H/lib/x86_64-linux-gnu
exec $H/usr/bin/aarch64-linux-gnu-gcc-12 --sysroot=/ \
    -B$H/usr/libexec/gcc-cross/aarch64-linux-gnu/12/ -B$H/usr/lib/gcc-cross/aarch64-linux-gnu/12/ \
    -B$H/usr/aarch64-linux-gnu/bin/ "$@"
EOF
            chmod +x "$BOX$wrap"
            CC_ARGS=(-x -e "CC=$wrap" -e "LDSHARED=$wrap -shared")
            ;;
        *) die "EDGEFL_BOARD_CC must be board or cross, not '$CC_MODE'" ;;
    esac
}

# the board's dependencies as pip reads them: pyproject.toml's [project] dependencies
project_deps() {
    python3 - "$REPO/pyproject.toml" <<'EOF2'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
EOF2
}

# $VENV with edgefl's dependencies and not edgefl. Installing them is most of an install's
# time under qemu (unpacking and byte-compiling numpy, onnxruntime, cryptography) and says
# nothing about this checkout, so the venv they make is kept in the box, keyed by the
# dependency list, and copied back for the next install; `pip install ./edgefl` then finds
# them installed and builds and installs edgefl alone, the way it would on a board that had
# them. EDGEFL_BOARD_FRESH=1, or a python3 without tomllib, makes the venv from nothing.
deps_venv() {
    local deps key keep
    deps=$(project_deps 2>/dev/null) || deps=
    if [ -z "$deps" ] || [ "${EDGEFL_BOARD_FRESH:-0}" = 1 ]; then
        say "python3 -m venv $VENV (Debian's python3.11, under qemu)"
        (box_run -- /usr/bin/python3 -m venv "$VENV")
        return
    fi
    key=$(printf '%s\n' "$deps" | sha256sum | cut -c1-12)
    keep=/opt/edgefl-deps/$key
    if [ -e "$BOX$keep/.deps-ok" ]; then
        say "the venv with edgefl's dependencies, kept at $keep"
        mkdir -p "$BOX/opt/edgefl" && cp -a "$BOX$keep/venv" "$BOX$VENV"
        return
    fi
    say "python3 -m venv $VENV (Debian's python3.11, under qemu), then edgefl's dependencies"
    rm -rf "$BOX/opt/edgefl-deps" && mkdir -p "$BOX$keep"
    printf '%s\n' "$deps" >"$BOX$keep/requirements.txt"
    (box_run -- /usr/bin/python3 -m venv "$VENV")
    (box_run -- "$VENV/bin/pip" install -q -r "$keep/requirements.txt")
    cp -a "$BOX$VENV" "$BOX$keep/venv" && touch "$BOX$keep/.deps-ok"
}

install_edgefl() {
    build_userland
    [ "$CC_MODE" = cross ] && need_tools
    local t0=$SECONDS src=/opt/src/edgefl
    say "copying this checkout to $src in the box"
    rm -rf "$BOX$src" && mkdir -p "$BOX$src"
    # the files a clone has, as they are now, and new ones not ignored (but not CI's venv)
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard | grep -zv '^\.ci/venv/' |
        xargs -0 tar -c --ignore-failed-read 2>/dev/null) | tar -x -C "$BOX$src"
    rm -rf "$BOX/opt/edgefl"
    deps_venv
    local t1=$SECONDS
    say "pip install ./edgefl (C core: $CC_MODE)"
    cc_env
    (box_run -e EDGEFL_STRICT_BUILD=1 "${CC_ARGS[@]}" -- \
        /bin/sh -c "cd /opt/src && $VENV/bin/pip install -q ./edgefl")
    say "installed in $((SECONDS - t0)) s (venv $((t1 - t0)) s, pip install ./edgefl $((SECONDS - t1)) s)"
}

info() {
    (box_run -- $VENV/bin/edgefl info)
}

main() {
    local cmd=${1:-all}
    [ $# -gt 0 ] && shift
    case "$cmd" in
        userland) build_userland ;;
        install) (install_edgefl) ;;
        info) info ;;
        path) echo "$BOX" ;;
        run) box_run "$@" ;;
        fleet)
            # the host's side (aggregator, native client, the x86 reference) from this
            # checkout, with its dev install (pip install -e '.[dev]')
            cd "$REPO"
            PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" EDGEFL_BOARD_FULL=1 \
                python3 -m pytest -q -s -m board tests/test_board.py "$@" ;;
        all)
            local t0=$SECONDS
            build_userland; local t1=$SECONDS
            (install_edgefl); local t2=$SECONDS
            (info); local t3=$SECONDS
            (main fleet); local t4=$SECONDS
            say "timings: userland $((t1 - t0)) s, install $((t2 - t1)) s, info $((t3 - t2)) s, fleet $((t4 - t3)) s"
            ;;
        *) die "unknown command '$cmd' (userland, install, info, fleet, run, path, all)" ;;
    esac
}

main "$@"
