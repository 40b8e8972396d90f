#!/usr/bin/env bash
# The image's entrypoint. A command runs as given (docker run IMAGE python3 -m MaxText.train ...; the default is
# the smoke test); a config file first trains with it:
#
#   docker run --gpus all IMAGE configs/deepseek3-tiny.yml hardware=gpu   # python3 -m MaxText.train configs/...
#
# exec: the command replaces this shell, so a `docker stop`'s SIGTERM reaches it.
set -euo pipefail
case "${1:-}" in
  *.yml|*.yaml) exec python3 -m MaxText.train "$@" ;;
  "") echo "entrypoint: no command given (the image's default is: bash docker/smoke.sh)" >&2; exit 2 ;;
esac
exec "$@"
