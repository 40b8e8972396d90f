#!/usr/bin/env bash
# Build the maxtext-moe container from docker/Dockerfile, tagged with the
# manifest's versions, optionally exported as an enroot .sqsh for SLURM + pyxis.
#
#   scripts/build_container.sh [--engine docker|podman] [--base IMAGE] [--offline]
#                              [--sqsh FILE] [--push] [--dry-run]
#
#   --engine   docker (buildx) or podman; default: the first one whose engine answers
#   --base     base image (default: docker/manifest.yaml's base_image)
#   --offline  air-gapped: install from ./wheelhouse instead of an index (build it on a
#              connected machine first: scripts/wheelhouse --image none --no-size-cap)
#   --sqsh     also write an enroot squashfs image (needs enroot)
#   --push     push the tags after building (docker buildx --push / podman push)
#   --dry-run  print the commands, run nothing (no engine needed)
#
# Tags: maxtext-moe:<version>-maxtext<maxtext>-jax<jax> and maxtext-moe:latest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
manifest="$repo/docker/manifest.yaml"
die() { echo "build_container: error: $*" >&2; exit 1; }

engine="" base="" wheels=online sqsh="" push=0 dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) engine="${2:?--engine needs docker or podman}"; shift 2 ;;
    --base) base="${2:?--base needs an image}"; shift 2 ;;
    --offline) wheels=offline; shift ;;
    --sqsh) sqsh="${2:?--sqsh needs a file name}"; shift 2 ;;
    --push) push=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

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
base="${base:-$(manifest_value base_image repository):$(manifest_value base_image tag)${digest:+@$digest}}"
name="$(manifest_value "" image_name)"
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

args=(-f "$repo/docker/Dockerfile" --build-arg "BASE_IMAGE=$base" --build-arg "WHEELS=$wheels"
      -t "$name:$tag" -t "$name:latest" "$repo")
case "$engine" in
  docker) build=(docker buildx build --load "${args[@]}") ;;
  podman) build=(podman build --format docker "${args[@]}") ;;
  *) die "unknown engine '$engine' (docker or podman)" ;;
esac

run() { echo "+ $*"; [ "$dry" = 1 ] || "$@"; }
echo "build_container: $name:$tag from $base (wheels: $wheels, engine: $engine)"
run "${build[@]}"
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
