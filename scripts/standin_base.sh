#!/usr/bin/env bash
# Build a STAND-IN for the NGC base image, for building and smoke-testing our
# Dockerfile on a machine that cannot pull ghcr.io/nvidia/jax (CPU only).
#
#   scripts/standin_base.sh [--python PREFIX] [--work DIR] [--tag IMAGE]
#
#   --python  a CPython 3.12 installation prefix built on Debian bookworm
#             (default: the first of $(pyenv prefix 3.12), /usr/local), copied to /usr/local
#   --work    scratch folder for the root file system and wheels (default: /tmp/maxtext-moe-standin)
#   --tag     image name (default: docker/manifest.yaml's standin_base:bookworm-py3.12-jax<jax>)
#
# What it holds of the NGC base, for a CPU: Debian bookworm (mmdebstrap, Debian
# packages only), Python 3.12 as `python3` with pip, jax and jaxlib at the
# manifest's pins from PyPI (CPU wheels: no CUDA, no Transformer Engine),
# packaging and pyyaml (scripts/wheelhouse runs inside the base before anything
# is installed; the NGC image's Python carries both), and the tools the
# Dockerfile uses (bash, groupadd/useradd). Debian has no Python
# 3.12 package (bookworm ships 3.11, trixie 3.13) and PyPI no interpreter, so
# the interpreter is a CPython 3.12 build of this machine, compiled against the
# same bookworm libraries. The image carries /etc/maxtext-moe-standin and the
# label org.maxtext-moe.standin=true: docker/check_image.py reads the file and
# then accepts CPU jax without TE, and nothing else changes.
#
# Needs root, mmdebstrap and podman (apt-get install podman mmdebstrap). Exit 2
# on a bad argument or a missing tool, 1 when a step fails. Prints the tag last.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "standin_base: error: $*" >&2; exit "${2:-1}"; }

py_prefix="" work="/tmp/maxtext-moe-standin" tag=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python) py_prefix="${2:?--python needs a prefix}"; shift 2 ;;
    --work) work="${2:?--work needs a folder}"; shift 2 ;;
    --tag) tag="${2:?--tag needs an image name}"; shift 2 ;;
    -h|--help) sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" 2 ;;
  esac
done
for tool in mmdebstrap podman; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is not installed (apt-get install podman mmdebstrap)" 2
done
jax="$(sed -n 's/^  jax: "\(.*\)".*/\1/p' "$repo/docker/manifest.yaml")"
[ -n "$jax" ] || die "could not read pins.jax from $repo/docker/manifest.yaml"
name="$(sed -n 's/^standin_base: *\([^ #]*\).*/\1/p' "$repo/docker/manifest.yaml")"
[ -n "$name" ] || die "could not read standin_base from $repo/docker/manifest.yaml"
tag="${tag:-$name:bookworm-py3.12-jax$jax}"

if [ -z "$py_prefix" ]; then
  for cand in "$(pyenv prefix 3.12 2>/dev/null || true)" "$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.* 2>/dev/null | tail -n1)" /usr/local; do
    [ -n "$cand" ] && [ -x "$cand/bin/python3.12" ] && { py_prefix="$cand"; break; }
  done
fi
[ -n "$py_prefix" ] && [ -x "$py_prefix/bin/python3.12" ] \
  || die "no CPython 3.12 found (give --python PREFIX holding bin/python3.12)" 2

mkdir -p "$work"
started=$SECONDS
# 1. Debian bookworm, minimal, plus the shared libraries CPython's extension
#    modules link (ssl, ffi, sqlite, ...) and jaxlib's C++ runtime.
if [ ! -s "$work/rootfs.tar" ]; then
  echo "standin_base: Debian bookworm root file system (mmdebstrap)"
  mmdebstrap --variant=minbase --quiet \
    --include=passwd,ca-certificates,libssl3,libffi8,zlib1g,libbz2-1.0,liblzma5,libsqlite3-0,libreadline8,libncursesw6,libtinfo6,libuuid1,libgdbm6,libexpat1,libtirpc3,libcrypt1,libstdc++6 \
    --format=tar bookworm "$work/rootfs.tar.part" http://deb.debian.org/debian
  mv "$work/rootfs.tar.part" "$work/rootfs.tar"
fi
podman import --quiet "$work/rootfs.tar" localhost/maxtext-moe-standin-debian:bookworm >/dev/null

# 2. The build context: the interpreter and jax's CPU wheels (downloaded here,
#    where the index is reachable; the build itself needs no network).
ctx="$work/context"
rm -rf "$ctx" && mkdir -p "$ctx/wheels"
cp -a "$py_prefix/." "$ctx/python/"
# A base's interpreter, not this machine's: no test suite or static library (150 MB), and
# nothing installed but pip (a .pth this machine's sandbox adds, say).
rm -rf "$ctx/python/lib/python3.12/test" "$ctx/python/lib/libpython3.12.a" "$ctx/python/lib/python3.12/config-3.12-x86_64-linux-gnu/libpython3.12.a"
find "$ctx/python/lib/python3.12/site-packages" -mindepth 1 -maxdepth 1 ! -name 'pip' ! -name 'pip-*' ! -name README.txt -exec rm -rf {} +
"$py_prefix/bin/python3.12" -m pip download --quiet --only-binary=:all: --dest "$ctx/wheels" \
  "jax==$jax" "jaxlib==$jax" packaging pyyaml
cat >"$ctx/Containerfile" <<'EOF'
FROM localhost/maxtext-moe-standin-debian:bookworm
LABEL org.maxtext-moe.standin="true" \
      org.opencontainers.image.description="STAND-IN for the NGC JAX base: Debian bookworm, CPython 3.12, CPU jax; no CUDA, no TE"
COPY python/ /usr/local/
COPY wheels/ /tmp/wheels/
# The NGC base's Python is the system one; here /usr/local's, first on PATH.
RUN ldconfig \
 && python3 --version \
 && python3 -m pip install --no-index --no-cache-dir --find-links /tmp/wheels jax jaxlib packaging pyyaml \
 && rm -rf /tmp/wheels \
 && echo "stand-in for the NGC base: CPU jax, no CUDA, no Transformer Engine" > /etc/maxtext-moe-standin
EOF
echo "standin_base: building $tag"
isolation=()
[ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ] || isolation=(--isolation=chroot)
podman build --quiet "${isolation[@]}" --format docker -t "$tag" "$ctx" >/dev/null
echo "standin_base: done in $((SECONDS - started)) s: $tag"
echo "$tag"
