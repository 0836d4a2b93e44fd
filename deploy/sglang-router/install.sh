#!/usr/bin/env bash
# Install the SGLang router baseline (sglang-router==0.3.2, from PyPI) into its
# own virtualenv, then check that it starts and serves /health.
#
# Idempotent: re-running with the right version already installed only re-runs
# the start check.  Override the venv with PG_SGLANG_VENV, the interpreter with
# PG_SGLANG_PYTHON, the check port with PG_SGLANG_CHECK_PORT.
# Skip the start check with PG_SGLANG_SKIP_CHECK=1.
set -euo pipefail

VERSION="0.3.2"
VENV="${PG_SGLANG_VENV:-$HOME/.cache/prefix-gateway/sglang-router-venv}"
PY="${PG_SGLANG_PYTHON:-python3}"
CHECK_PORT="${PG_SGLANG_CHECK_PORT:-0}"

log() { echo "[sglang-router install] $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
fi

installed="$("$VENV/bin/python" - <<'PY' 2>/dev/null || true
import importlib.metadata as m
try:
    print(m.version("sglang-router"))
except m.PackageNotFoundError:
    pass
PY
)"

if [ "$installed" != "$VERSION" ]; then
    log "installing sglang-router==$VERSION (found: ${installed:-none})"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "sglang-router==$VERSION"
else
    log "sglang-router==$VERSION already installed in $VENV"
fi

"$VENV/bin/python" -c "import sglang_router, sglang_router.launch_router" \
    || { log "import check failed"; exit 1; }

if [ "${PG_SGLANG_SKIP_CHECK:-0}" = "1" ]; then
    log "start check skipped"
    exit 0
fi

# Start check: the router with no workers still binds and answers /liveness.
free_port() {
    "$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
if [ "$CHECK_PORT" = "0" ]; then
    CHECK_PORT="$(free_port)"
fi
# The metrics server defaults to 0.0.0.0:29000 and refuses port 0: give it a free port.
METRICS_PORT="$(free_port)"
LOG="$(mktemp -t sglang-router-check.XXXXXX.log)"
"$VENV/bin/python" -m sglang_router.launch_router \
    --host 127.0.0.1 --port "$CHECK_PORT" --policy cache_aware \
    --prometheus-host 127.0.0.1 --prometheus-port "$METRICS_PORT" >"$LOG" 2>&1 &
PID=$!
cleanup() { kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; }
trap cleanup EXIT

ok=0
for _ in $(seq 1 100); do
    if ! kill -0 "$PID" 2>/dev/null; then break; fi
    if "$VENV/bin/python" - "$CHECK_PORT" <<'PY' 2>/dev/null; then ok=1; break; fi
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/liveness", timeout=1).read()
PY
    sleep 0.2
done

if [ "$ok" != "1" ]; then
    log "router did not start; log follows ($LOG)"
    cat "$LOG" >&2
    exit 1
fi
log "router started and answered /liveness on port $CHECK_PORT; OK"
rm -f "$LOG"
