#!/usr/bin/env bash
# Installs a compose implementation for tests/deploy (it resolves docker-compose.yml with `config`
# for every profile; no Docker engine is needed or started); without one those tests skip and say
# why. Idempotent. Debian/Ubuntu as root: the distribution's docker-compose (Debian 12: 1.29.2, a
# few MB of Python packages, seconds). Where the Docker CLI has its compose plugin, that is used.
set -euo pipefail
if docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends docker-compose >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends docker-compose >/dev/null; }
  echo "compose installed: $(docker-compose version --short 2>&1 | head -1)"
else
  echo "no compose implementation installed (needs root and apt-get): the compose tests will skip;" \
       "install the Docker compose plugin to run them" >&2
fi
