#!/usr/bin/env bash
# CI: the pool's real parts (issue 16 item 4). Installs the `pool` extra (ray, psycopg, alembic), starts a
# local Ray cluster (a head that takes no tasks plus 2 worker nodes with 1 CPU each: two verdicts at once on
# a 2-core machine, CPU only) and a PostgreSQL server (Debian's package) on 127.0.0.1, and writes their
# addresses to .ci/services.env, which .ci/run sources before the tests. Stop them with .ci/stop-services.sh.
# Free ports are picked at run time; the server's files live in a fresh temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
export PIP_DISABLE_PIP_VERSION_CHECK=1
# (SERVICES_NO_PIP=1: start the servers only, for a machine whose environment has the extra already)
[ -n "${SERVICES_NO_PIP:-}" ] || python3 -m pip install -q -e '.[pool]'
ENV_FILE=.ci/services.env
: >"$ENV_FILE"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi

# ---- PostgreSQL: initdb + pg_ctl into a temporary folder, trust auth on 127.0.0.1 only --------------------
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$PG_BIN" ]; then
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q postgresql
  PG_BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
fi
PG_DIR=$(mktemp -d /tmp/workbench-pg.XXXXXX)
PG_PORT=$(free_port)
# initdb refuses to run as root: run the server as the package's postgres user then
if [ "$(id -u)" -eq 0 ]; then chown postgres "$PG_DIR"; AS_PG=(runuser -u postgres --); else AS_PG=(); fi
"${AS_PG[@]}" "$PG_BIN/initdb" -D "$PG_DIR/data" -U workbench --auth=trust -E UTF8 >/dev/null
"${AS_PG[@]}" "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -o \
  "-p $PG_PORT -c listen_addresses=127.0.0.1 -k $PG_DIR -c max_connections=200 -c fsync=on" start >/dev/null
"$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U workbench workbench
{
  echo "export WORKBENCH_TEST_POSTGRES_URL=postgresql+psycopg://workbench@127.0.0.1:$PG_PORT/workbench"
  echo "export CI_PG_CTL='${AS_PG[*]} $PG_BIN/pg_ctl -D $PG_DIR/data'"
} >>"$ENV_FILE"
echo "install-services.sh: PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$PG_PORT ($PG_DIR)"

# ---- Ray: a head that schedules nothing itself, and 2 one-CPU worker nodes on this machine ---------------
RAY_PORT=$(free_port)
CLIENT_PORT=$(free_port)
RAY_OPTS=(--disable-usage-stats --object-store-memory 100000000)
ray start --head --port "$RAY_PORT" --ray-client-server-port "$CLIENT_PORT" --num-cpus 0 --num-gpus 0 \
  --include-dashboard false "${RAY_OPTS[@]}" >/dev/null
for _ in 1 2; do
  ray start --address "127.0.0.1:$RAY_PORT" --num-cpus 1 --num-gpus 0 "${RAY_OPTS[@]}" >/dev/null
done
echo "export WORKBENCH_TEST_RAY_ADDRESS=ray://127.0.0.1:$CLIENT_PORT" >>"$ENV_FILE"
echo "install-services.sh: Ray $(python3 -c 'import ray; print(ray.__version__)') head 127.0.0.1:$RAY_PORT" \
     "(client ray://127.0.0.1:$CLIENT_PORT), 2 worker nodes"
echo "install-services.sh: done in $(( $(date +%s) - start )) s; addresses in $ENV_FILE"
