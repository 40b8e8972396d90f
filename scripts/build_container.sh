#!/usr/bin/env bash
# Build the maxtext-moe container from docker/Dockerfile, tagged with the
# manifest's versions, optionally exported as an enroot .sqsh for SLURM + pyxis.
#
#   scripts/build_container.sh [--engine docker|podman] [--base IMAGE] [--offline]
#                              [--standin] [--smoke-cpu] [--isolation chroot|oci] [--no-cache]
#                              [--sqsh FILE] [--push] [--dry-run]
#
#   --engine   docker (buildx) or podman; default: the first one whose engine answers
#   --base     base image (default: docker/manifest.yaml's base_image)
#   --standin  on the CPU stand-in for the NGC base (scripts/standin_base.sh, made first if
#              absent; podman), with --smoke-cpu: for a machine that cannot pull the NGC base
#   --smoke-cpu  then build the Dockerfile's smoke-cpu stage: docker/smoke.sh with
#              SMOKE_DEVICE=cpu (the pins, 3 steps of the tiny config on the CPU; the GPU
#              items "skipped: no GPU") on a builder where `run` is not possible
#   --no-cache  rebuild every layer (so that check_image and the smoke run and print again)
#   --isolation  podman's RUN isolation; default: chroot where /sys/fs/cgroup is not cgroup v2
#              (podman's OCI isolation refuses v1 and hybrid hierarchies), else oci
#   --offline  air-gapped: install from ./wheelhouse instead of an index (build it on a
#              connected machine first: scripts/wheelhouse --image none --no-size-cap)
#   --sqsh     also write an enroot squashfs image (needs enroot)
#   --push     push the tags after building (docker buildx --push / podman push)
#   --dry-run  print the commands, run nothing (no engine needed)
#
# Tags: maxtext-moe:<version>-maxtext<maxtext>-jax<jax> and maxtext-moe:latest (on the
# stand-in: maxtext-moe-standin:..., so it is never taken for the real image).
# Exit 2: a bad argument; 1: no engine, or the build failed (its cause in one line
# where it is known: a full disk, a base without Python 3.12); the smoke's own
# PASS/FAIL/SKIP lines are printed as they come.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
manifest="$repo/docker/manifest.yaml"
die() { echo "build_container: error: $1" >&2; exit "${2:-1}"; }

# An option's value: the next word, unless there is none or it is another option.
need() { [ $# -ge 3 ] && [ -n "$3" ] && [ "${3#--}" = "$3" ] || die "$1 needs $2" 2; }

engine="" base="" wheels=online sqsh="" push=0 dry=0 standin=0 smoke=0 isolation="" no_cache=()
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) need "$1" "a value: docker or podman" "${@:2:1}"; engine="$2"; shift 2 ;;
    --base) need "$1" "an image" "${@:2:1}"; base="$2"; shift 2 ;;
    --standin) standin=1 smoke=1; shift ;;
    --smoke-cpu) smoke=1; shift ;;
    --isolation) need "$1" "a value: chroot or oci" "${@:2:1}"; isolation="$2"; shift 2 ;;
    --offline) wheels=offline; shift ;;
    --no-cache) no_cache=(--no-cache); shift ;;
    --sqsh) need "$1" "a file name" "${@:2:1}"; sqsh="$2"; shift 2 ;;
    --push) push=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" 2 ;;
  esac
done
case "$engine" in ""|docker|podman) ;; *) die "--engine $engine: must be docker or podman" 2 ;; esac
case "$isolation" in ""|chroot|oci) ;; *) die "--isolation $isolation: must be chroot or oci" 2 ;; esac
[ -n "$isolation" ] && [ "$engine" = docker ] && die "--isolation is podman's; docker buildx has none" 2
if [ "$standin" = 1 ]; then
  [ -z "$base" ] || die "--standin and --base both name the base; give one" 2
  [ "$engine" != docker ] || die "--standin builds with podman (its base is a local podman image)" 2
  engine=podman
fi

# Manifest values, read with a plain-shell parser: the keys used here are
# simple `key: value` lines (tests/test_manifest.py checks this parse against PyYAML).
manifest_value() {  # manifest_value SECTION KEY  (SECTION "" for top-level keys)
  awk -v section="$1" -v key="$2" '
    /^[^ #][^:]*:/ { top = $1; sub(":", "", top) }
    {
      line = $0; sub(/#.*/, "", line)
      if (section == "" && line ~ "^" key ":") { found = line }
      else if (section != "" && top == section && line ~ "^  " key ":") { found = line }
      if (found != "") { sub(/^[^:]*:[ ]*/, "", found); gsub(/["'\'' ]/, "", found); print found; exit }
    }' "$manifest"
}
pyproject_version() { sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -n1; }

digest="$(manifest_value base_image digest)"
standin_tag="$(manifest_value "" standin_base):bookworm-py3.12-jax$(manifest_value pins jax)"  # standin_base.sh's
[ "$standin" = 1 ] && base="$standin_tag"
base="${base:-$(manifest_value base_image repository):$(manifest_value base_image tag)${digest:+@$digest}}"
name="$(manifest_value "" image_name)"
[ "$standin" = 1 ] && name="$name-standin"
tag="$(pyproject_version)-maxtext$(manifest_value pins maxtext)-jax$(manifest_value pins jax)"
[ -n "$name" ] && [ "$tag" != "-maxtext-jax" ] || die "could not read versions from $manifest"
[ "$wheels" = offline ] && ! compgen -G "$repo/wheelhouse/*.whl" >/dev/null \
  && die "--offline needs wheels in $repo/wheelhouse (scripts/wheelhouse --image none --no-size-cap)"

engine_ok() {  # the CLI exists AND its engine answers (a docker CLI without a daemon is common)
  command -v "$1" >/dev/null 2>&1 || return 1
  case "$1" in
    docker) docker info >/dev/null 2>&1 && docker buildx version >/dev/null 2>&1 ;;
    podman) podman info >/dev/null 2>&1 ;;
  esac
}
if [ "$dry" = 0 ] && [ -n "$engine" ] && ! engine_ok "$engine"; then
  # An engine chosen (--engine, or podman for --standin): the message is about that one alone.
  why="--engine $engine"; [ "$standin" = 1 ] && why="--standin (it builds with podman)"
  if ! command -v "$engine" >/dev/null 2>&1; then
    die "$why: $engine is not installed$([ "$engine" = podman ] && echo " (apt-get install podman)")"
  fi
  case "$engine" in
    docker) docker info >/dev/null 2>&1 && die "$why: docker answers but has no buildx plugin (install docker-buildx)"
            die "$why: no Docker engine answers ('docker info' fails; is dockerd running, and may this user reach its socket?)" ;;
    podman) die "$why: 'podman info' fails" ;;
  esac
fi
if [ "$dry" = 0 ]; then
  if [ -z "$engine" ]; then
    for cand in docker podman; do engine_ok "$cand" && { engine="$cand"; break; }; done
  fi
  if [ -z "$engine" ] || ! engine_ok "$engine"; then
    msg="no container engine available"
    command -v docker >/dev/null 2>&1 && ! docker info >/dev/null 2>&1 \
      && msg="$msg: the docker CLI is installed but no Docker engine answers ('docker info' fails; is dockerd running, and may this user reach its socket?)"
    command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1 && ! docker buildx version >/dev/null 2>&1 \
      && msg="$msg: docker answers but has no buildx plugin (install docker-buildx)"
    command -v podman >/dev/null 2>&1 && ! podman info >/dev/null 2>&1 && msg="$msg; podman is installed but 'podman info' fails"
    command -v docker >/dev/null 2>&1 || command -v podman >/dev/null 2>&1 || msg="$msg: neither docker nor podman is installed"
    die "$msg. Build on a machine with Docker (buildx) or Podman, or use --dry-run to see the commands."
  fi
fi
[ -n "$engine" ] || engine=docker

if [ "$engine" = podman ] && [ -z "$isolation" ]; then
  isolation=oci; [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ] || isolation=chroot
fi
# The image's labels (the Dockerfile's last step): the release, and the commit built ("-dirty": with changes
# not committed; "unknown": not a git checkout).
revision="$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)"
[ "$revision" != unknown ] && ! git -C "$repo" diff --quiet HEAD 2>/dev/null && revision="$revision-dirty"
args=(-f "$repo/docker/Dockerfile" --build-arg "BASE_IMAGE=$base" --build-arg "WHEELS=$wheels"
      --build-arg "VERSION=$(pyproject_version)" --build-arg "REVISION=$revision")
case "$engine" in
  docker) build=(docker buildx build --load "${args[@]}") ;;
  podman) build=(podman build --format docker --isolation="$isolation" "${args[@]}") ;;
esac

run() { echo "+ $*"; [ "$dry" = 1 ] || "$@"; }
# A build's output goes to the terminal and to a log, from which a failure's known cause is
# told in one line: the Dockerfile's own "maxtext-moe: ..." lines, scripts/wheelhouse's and
# docker/check_image.py's, or a full disk.
log="$(mktemp "${TMPDIR:-/tmp}/build_container.XXXXXX")"
trap 'rm -f "$log"' EXIT
build_step() {  # build_step WHAT ARGS...: the engine's build, and one line if it fails
  local what="$1"; shift
  echo "+ ${build[*]} $* $repo"
  [ "$dry" = 1 ] && return 0
  if "${build[@]}" "$@" "$repo" 2>&1 | tee "$log"; then return 0; fi
  # Lines our steps print at a line's start (the engine echoes each RUN's text, which holds them too).
  local cause; cause="$(grep -E '^(maxtext-moe|wheelhouse|check_image): ' "$log" | tail -n1 || true)"
  grep -qi 'no space left on device' "$log" \
    && cause="no space left on device (the engine's storage: $( [ "$engine" = podman ] && podman info --format '{{.Store.GraphRoot}}' 2>/dev/null || echo "docker's data-root"))"
  die "$what failed${cause:+: $cause}"
}
if [ "$standin" = 1 ] && [ "$dry" = 0 ] && ! podman image exists "$base"; then
  echo "build_container: the stand-in base $base is absent: scripts/standin_base.sh"
  "$repo/scripts/standin_base.sh" --tag "$base" || die "scripts/standin_base.sh failed"
fi
echo "build_container: $name:$tag from $base (wheels: $wheels, engine: $engine${isolation:+, isolation: $isolation})"
build_step "the image's build" "${no_cache[@]}" --target runtime -t "$name:$tag" -t "$name:latest"
if [ "$smoke" = 1 ]; then
  # The smoke-cpu stage reuses the layers just built; its RUN is the smoke, printed as it runs, and runs every
  # time: SMOKE_RUN is new each build, so the RUN's cache key is (a --no-cache runtime can hash to the cached one).
  build_step "the CPU smoke test" --build-arg "SMOKE_RUN=$(date +%s%N)" --target smoke-cpu -t "$name-smoke-cpu:$tag"
  [ "$dry" = 1 ] || echo "build_container: CPU smoke passed in the image (the GPU items: skipped, no GPU)"
fi
if [ "$push" = 1 ]; then
  run "$engine" push "$name:$tag"
fi
if [ -n "$sqsh" ]; then
  if [ "$dry" = 0 ] && ! command -v enroot >/dev/null 2>&1; then
    die "--sqsh needs enroot (https://github.com/NVIDIA/enroot); the image $name:$tag was built"
  fi
  # enroot reads the local engine's image store: dockerd:// or podman://.
  run enroot import --output "$sqsh" "${engine/docker/dockerd}://$name:$tag"
  echo "build_container: SLURM + pyxis: srun --container-image=$(realpath -m "$sqsh") ..."
fi
echo "build_container: done: $name:$tag"
