#!/bin/sh
# The official image's entrypoint, in the part docker-compose.yml uses: on the first start (an
# empty $PGDATA) initdb with POSTGRES_USER as the superuser and POSTGRES_PASSWORD as its password,
# then POSTGRES_DB; every later start just runs the server. Clients from other containers log in
# with the password (scram-sha-256); local socket connections (pg_isready) are trusted.
set -e
if [ "$1" != "postgres" ]; then
    exec "$@"
fi
as_postgres() { setpriv --reuid postgres --regid postgres --init-groups "$@"; }
chown -R postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?the postgres image needs POSTGRES_PASSWORD}"
    user="${POSTGRES_USER:-postgres}"
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chown postgres "$pwfile"
    as_postgres initdb --username="$user" --pwfile="$pwfile" --auth-local=trust \
        --auth-host=scram-sha-256 -D "$PGDATA" >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    db="${POSTGRES_DB:-$user}"
    if [ "$db" != "postgres" ]; then
        # A server on the socket only, for the set-up, as the official entrypoint does.
        as_postgres pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        as_postgres psql -v ON_ERROR_STOP=1 --username="$user" --dbname=postgres \
            -c "CREATE DATABASE \"$db\"" >/dev/null
        as_postgres pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
    echo "postgres: initialised $PGDATA (role $user, database $db)"
fi
exec setpriv --reuid postgres --regid postgres --init-groups "$@" -c listen_addresses="*"
