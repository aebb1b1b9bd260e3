#!/usr/bin/env bash
# Stop what .ci/install-services.sh started (the Ray cluster and the PostgreSQL server); not run by .ci/run
# (CI's machine goes away), for a local run of the services. Its temporary folder stays for the server's log.
# `ray stop` stops every Ray node of this user on the machine, not only the ones started here.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -f .ci/services.env ] || { echo "stop-services.sh: no .ci/services.env: nothing started"; exit 0; }
# shellcheck disable=SC1091
source .ci/services.env
ray stop --force >/dev/null 2>&1 && echo "stop-services.sh: ray stopped"
[ -n "${CI_PG_CTL:-}" ] && $CI_PG_CTL -m fast stop >/dev/null && echo "stop-services.sh: PostgreSQL stopped"
rm -f .ci/services.env
