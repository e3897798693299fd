#!/bin/sh
# CI only: what the official redis image's docker-entrypoint.sh does for
# `redis-server` (hand /data to the redis user, drop root), with setpriv
# (util-linux, in minbase) instead of gosu. One addition for host
# networking: with REDIS_PORT set, Redis listens on 127.0.0.1:REDIS_PORT
# instead of every address on 6379 (docker-compose.ci.yaml sets it, so
# docker-compose.yaml's command runs unchanged).
set -e
if [ "$1" = redis-server ] || [ "${1#-}" != "$1" ]; then
    [ "$1" = redis-server ] || set -- redis-server "$@"
    if [ -n "${REDIS_PORT:-}" ]; then
        set -- "$@" --port "$REDIS_PORT" --bind 127.0.0.1
    fi
    if [ "$(id -u)" = 0 ]; then
        find . \! -user redis -exec chown redis '{}' +
        exec setpriv --reuid=redis --regid=redis --init-groups "$@"
    fi
fi
exec "$@"
