#!/usr/bin/env bash
# Builds every image, or only those named (`tools/images.sh reward trainer`), with the first
# container engine that answers: docker, then podman. Context: the repository root.
#   services/<name>/Dockerfile   a service's image, tagged with the service's version
#   images/<name>/Dockerfile     a sandbox image that ships with a service (its
#                                `LABEL dev.orchard.ships-with="<service>"`), tagged with that
#                                service's version; naming the service builds it too
#                                (`tools/images.sh rollout` also builds gui-browser)
# Extra build arguments: $IMAGE_BUILD_ARGS (e.g. the trainer's "--build-arg BASE=..." for a GPU
# base, see services/trainer/Dockerfile). Tags: $IMAGE_PREFIX<name>:<version>, the version from
# the installed distribution (the service's pyproject).
# `--list` first: print each Dockerfile and its tag, build nothing (no engine needed).
# No engine: says so and exits 0, since a machine without one can still test everything else.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${IMAGE_PREFIX:-ghcr.io/orchard-dev/orchard-}"
python="${PYTHON:-.venv/bin/python}"

# The service an images/<name>/Dockerfile ships with (empty when it names none).
ships_with() {
  sed -n 's/^LABEL dev\.orchard\.ships-with="\([a-z0-9-]*\)".*$/\1/p' "images/$1/Dockerfile"
}

# What to build, in order: the names given (all services and images when none), each service
# followed by the images that ship with it.
list=""
if [ "${1:-}" = "--list" ]; then
  list=1
  shift
fi
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for dockerfile in services/*/Dockerfile images/*/Dockerfile; do
    [ -f "$dockerfile" ] && names+=("$(basename "$(dirname "$dockerfile")")")
  done
fi
builds=()
for name in "${names[@]}"; do
  if [ -f "services/$name/Dockerfile" ]; then
    builds+=("services/$name/Dockerfile:$name:$name")
    for dockerfile in images/*/Dockerfile; do
      [ -f "$dockerfile" ] || continue
      image="$(basename "$(dirname "$dockerfile")")"
      if [ "$(ships_with "$image")" = "$name" ] && [[ " ${names[*]} " != *" $image "* ]]; then
        builds+=("$dockerfile:$image:$name")
      fi
    done
  elif [ -f "images/$name/Dockerfile" ]; then
    service="$(ships_with "$name")"
    if [ -z "$service" ]; then
      echo "images: images/$name/Dockerfile has no LABEL dev.orchard.ships-with=\"<service>\"" >&2
      exit 1
    fi
    builds+=("images/$name/Dockerfile:$name:$service")
  else
    echo "images: neither services/$name/Dockerfile nor images/$name/Dockerfile exists" >&2
    exit 1
  fi
done

# The tag of a build: $IMAGE_PREFIX<name>:<the version of the service it ships with>.
tag_of() {
  local version
  version="$("$python" -c 'import sys, importlib.metadata as m; print(m.version("orchard-" + sys.argv[1]))' "$2")"
  echo "${prefix}$1:${version}"
}

if [ -n "$list" ]; then
  for build in "${builds[@]}"; do
    IFS=: read -r dockerfile name service <<<"$build"
    echo "$dockerfile $(tag_of "$name" "$service")"
  done
  exit 0
fi

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

for build in "${builds[@]}"; do
  IFS=: read -r dockerfile name service <<<"$build"
  tag="$(tag_of "$name" "$service")"
  echo "images: $engine build $tag"
  # shellcheck disable=SC2086 # IMAGE_BUILD_ARGS is a list of words on purpose
  DOCKER_BUILDKIT=1 "$engine" build ${IMAGE_BUILD_ARGS:-} -f "$dockerfile" -t "$tag" .
done
