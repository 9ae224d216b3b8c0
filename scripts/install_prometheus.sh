#!/usr/bin/env bash
# Installs Prometheus (and promtool) for the tests that scrape Corral with a real Prometheus and
# check the Grafana dashboard's PromQL; without them those tests skip and say why. Idempotent.
# Debian/Ubuntu as root: the distribution's package (Debian 12: 2.42, ~23 MB, well under a minute).
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null; }
  echo "prometheus installed: $(prometheus --version 2>&1 | head -1)"
else
  echo "prometheus not installed (needs root and apt-get): the real-Prometheus tests will skip;" \
       "install prometheus and promtool from https://prometheus.io/download/ to run them" >&2
fi
