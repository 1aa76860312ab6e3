#!/bin/sh
# The official image's entrypoint, in the part docker-compose.yml uses: redis-server runs as the
# redis user, and without protected mode (the official build turns it off; with it on, Redis
# refuses every client from another container, since none sets a password).
set -e
if [ "$1" = "redis-server" ]; then
    chown -R redis:redis /data
    exec setpriv --reuid redis --regid redis --init-groups "$@" --protected-mode no
fi
exec "$@"
