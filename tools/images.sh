#!/usr/bin/env bash
# Builds every service image (services/<name>/Dockerfile, context: the repository root), or only
# those named (`tools/images.sh reward trainer`), with the first container engine that answers:
# docker, then podman. Extra build arguments: $IMAGE_BUILD_ARGS (e.g. the trainer's
# "--build-arg BASE=..." for a GPU base, see services/trainer/Dockerfile). Tags: $IMAGE_PREFIX<name>:<version>,
# the version from the installed distribution (the service's pyproject).
# No engine: says so and exits 0, since a machine without one can still test everything else.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${IMAGE_PREFIX:-ghcr.io/orchard-dev/orchard-}"
python="${PYTHON:-.venv/bin/python}"

engine=""
for candidate in docker podman; do
  if command -v "$candidate" >/dev/null && "$candidate" info >/dev/null 2>&1; then
    engine="$candidate"
    break
  fi
done
if [ -z "$engine" ]; then
  echo "images: no container engine answers here (docker or podman, with a running daemon for docker); nothing built."
  echo "images: the Dockerfiles are still linted by 'make charts' (hadolint)."
  exit 0
fi

names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for dockerfile in services/*/Dockerfile; do
    names+=("$(basename "$(dirname "$dockerfile")")")
  done
fi
for name in "${names[@]}"; do
  dockerfile="services/$name/Dockerfile"
  if [ ! -f "$dockerfile" ]; then
    echo "images: $dockerfile does not exist" >&2
    exit 1
  fi
  version="$("$python" -c 'import sys, importlib.metadata as m; print(m.version("orchard-" + sys.argv[1]))' "$name")"
  tag="${prefix}${name}:${version}"
  echo "images: $engine build $tag"
  # shellcheck disable=SC2086 # IMAGE_BUILD_ARGS is a list of words on purpose
  DOCKER_BUILDKIT=1 "$engine" build ${IMAGE_BUILD_ARGS:-} -f "$dockerfile" -t "$tag" .
done
