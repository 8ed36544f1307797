#!/usr/bin/env bash
# Start (or join) a Ray cluster of NNODES hosts and run mindrl-train on the head. Run this same script with the
# same settings on every node; the node whose CURRENT_IP is MASTER_ADDR is the head, the others are workers.
#   bash examples/ray_train.sh CONFIG_NAME [key=value ... | mindrl-train options]
# The head starts Ray with NPUS_PER_NODE devices, waits until NNODES nodes with all their devices have joined,
# trains, then stops its Ray. A worker joins (retrying until the head answers), stays attached while the head's
# cluster is up (it can be a pod's main process) and exits 0 once the head is gone. The script stops only the
# Ray processes it started (never `ray stop`), also on Ctrl-C / SIGTERM.
# Settings (environment):
#   NNODES (1)            number of nodes
#   NPUS_PER_NODE (16)    devices per node (NPUs, GPUs, or CPU stand-ins on the CPU platform)
#   MASTER_ADDR (127.0.0.1)  the head's address; MASTER_PORT (6379) its Ray (GCS) port
#   SOCKET_IFNAME         network interface whose IPv4 address is this node's CURRENT_IP
#   CURRENT_IP            this node's address (default: SOCKET_IFNAME's, else the first of `hostname -I`;
#                         on one node: MASTER_ADDR)
#   NODE_IPS              optional: every node's CURRENT_IP (space or comma separated), so that the head names
#                         the nodes still missing; without it the head names those that joined
#   JOIN_TIMEOUT (600)    seconds the head waits for all nodes, and a worker for the head to answer
#   HEAD_GONE_GRACE (30)  seconds a worker waits after the head stops answering before it stops its Ray and exits
#   OBJECT_STORE_MEMORY   optional: Ray object store bytes per node (Ray's default: 30% of RAM)
#   MINDRL_RUNTIME_ENV    environment variables for every Ray worker: a YAML file (default
#                         configs/envs/runtime_env.yaml; empty: none). A variable exported here wins over it.
#   RAY_AUTH_MODE         Ray token authentication; set to `token` when a token exists (RAY_AUTH_TOKEN,
#                         RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token): every node needs the head's token
#   LOOPBACK_CLUSTER (0)  TESTING ONLY: 1 allows loopback MASTER_ADDR / CURRENT_IP (127.x) with NNODES > 1, to run
#                         a cluster of several Ray nodes on one machine (e.g. a worker at CURRENT_IP=127.0.0.2)
# On Ascend, source CANN's set_env.sh first. jemalloc is preloaded when its library exists.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    [[ $# -lt 1 ]] && exit 2 || exit 0
fi
CONFIG="$1"; shift
NNODES="${NNODES:-1}"; NPUS_PER_NODE="${NPUS_PER_NODE:-16}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"; MASTER_PORT="${MASTER_PORT:-6379}"; JOIN_TIMEOUT="${JOIN_TIMEOUT:-600}"
HEAD_GONE_GRACE="${HEAD_GONE_GRACE:-30}"; LOOPBACK_CLUSTER="${LOOPBACK_CLUSTER:-0}"; NODE_IPS="${NODE_IPS:-}"
for v in NNODES NPUS_PER_NODE MASTER_PORT JOIN_TIMEOUT HEAD_GONE_GRACE; do
    [[ "${!v}" =~ ^[0-9]+$ && "${!v}" -gt 0 ]] || { echo "error: $v=${!v} must be a positive integer" >&2; exit 2; }
done
PY="python"; [[ -x "$ROOT/.venv/bin/python" ]] && PY="$ROOT/.venv/bin/python"
RAY="$(dirname "$(command -v "$PY")")/ray"; [[ -x "$RAY" ]] || RAY=ray

if [[ "$NNODES" -eq 1 ]]; then
    CURRENT_IP="$MASTER_ADDR"  # one node: it is the head
elif [[ -n "${CURRENT_IP:-}" ]]; then
    :
elif [[ -n "${SOCKET_IFNAME:-}" ]]; then
    CURRENT_IP=$(ip -4 addr show "$SOCKET_IFNAME" 2>/dev/null | awk '/inet /{print $2}' | cut -d/ -f1 | head -1)
    [[ -n "$CURRENT_IP" ]] || { echo "error: SOCKET_IFNAME=$SOCKET_IFNAME has no IPv4 address" >&2; exit 2; }
else
    CURRENT_IP=$( (hostname -I 2>/dev/null || echo 127.0.0.1) | awk '{print $1}')
fi
if [[ "$NNODES" -gt 1 && "$LOOPBACK_CLUSTER" != 1 ]]; then
    for v in MASTER_ADDR CURRENT_IP; do
        case "${!v}" in 127.*|localhost|::1) echo "error: $v=${!v} is a loopback address but NNODES=$NNODES:" \
            "set MASTER_ADDR to the head's address and SOCKET_IFNAME to the interface the nodes share" \
            "(LOOPBACK_CLUSTER=1 runs all nodes on this one machine, for testing only)" >&2; exit 2;; esac
    done
fi
for lib in /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 /usr/local/lib/libjemalloc.so.2; do
    if [[ -f "$lib" ]]; then export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"; break; fi
done
# Ray enables token auth on a head that finds a token but not on a joining node or a driver: say it to all.
if [[ -z "${RAY_AUTH_MODE:-}" ]] && [[ -n "${RAY_AUTH_TOKEN:-}" || -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]]; then
    export RAY_AUTH_MODE=token
fi
RESOURCE=$(cd "$ROOT" && "$PY" -c "from mindrl.platform import current_platform as p; print(p().ray_resource)") || exit 2
case "$RESOURCE" in
    GPU) DEVICES=(--num-gpus "$NPUS_PER_NODE");;
    NPU) DEVICES=(--resources "{\"NPU\": $NPUS_PER_NODE}");;
    *)   DEVICES=(--num-cpus "$NPUS_PER_NODE");;
esac
RAY_OPTS=(--block --disable-usage-stats --node-ip-address "$CURRENT_IP" "${DEVICES[@]}")
[[ -n "${OBJECT_STORE_MEMORY:-}" ]] && RAY_OPTS+=(--object-store-memory "$OBJECT_STORE_MEMORY")

# ---- the Ray node this script starts, and only it, is stopped on every exit path ----------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mindrl_launch.XXXXXX")
RAY_LOG="$WORK/ray_node.log"; RAY_PID=""; RAY_PGID=""; CHILD_PID=""
group_alive() {  # the live (not zombie) processes of process group $1
    local pid
    for pid in $(pgrep -g "$1" 2>/dev/null); do
        [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" == Z ]] || echo "$pid"
    done
}
stop_own_ray() {  # SIGTERM makes `ray start --block` drain and stop the processes it started; wait for that
    [[ -n "$RAY_PID" ]] || return 0
    if kill -0 "$RAY_PID" 2>/dev/null; then
        kill -TERM "$RAY_PID" 2>/dev/null
        for _ in $(seq 1 120); do kill -0 "$RAY_PID" 2>/dev/null || break; sleep 0.5; done
    fi
    # Its process group is its own session (start_own_ray): ours alone. What is left there after `ray start`
    # returned, or after 60 s, goes: e.g. a worker node's agents outlive their raylet when the head is gone first.
    if [[ -n "$RAY_PGID" ]]; then
        for _ in $(seq 1 10); do [[ -z "$(group_alive "$RAY_PGID")" ]] && break; sleep 0.5; done
        if [[ -n "$(group_alive "$RAY_PGID")" ]]; then
            kill -TERM -- "-$RAY_PGID" 2>/dev/null
            for _ in $(seq 1 6); do [[ -z "$(group_alive "$RAY_PGID")" ]] && break; sleep 0.5; done
            kill -KILL -- "-$RAY_PGID" 2>/dev/null
        fi
    fi
    wait "$RAY_PID" 2>/dev/null; RAY_PID=""; RAY_PGID=""
}
cleanup() {
    trap '' INT TERM  # a second Ctrl-C must not cut the shutdown short (it would leave Ray running)
    if [[ -n "$CHILD_PID" ]] && kill -0 "$CHILD_PID" 2>/dev/null; then
        kill -INT "$CHILD_PID"  # mindrl-train shuts its workers down on KeyboardInterrupt; give it 2 min
        for _ in $(seq 1 240); do kill -0 "$CHILD_PID" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$CHILD_PID" 2>/dev/null && kill -KILL "$CHILD_PID"
        wait "$CHILD_PID" 2>/dev/null
    fi
    stop_own_ray
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'echo "interrupted: stopping this node" >&2; exit 130' INT
trap 'echo "terminated: stopping this node" >&2; exit 143' TERM
start_own_ray() {  # in its own session: a Ctrl-C reaches us (we stop it in order), not Ray directly
    setsid "$RAY" start "$@" "${RAY_OPTS[@]}" >"$RAY_LOG" 2>&1 &
    RAY_PID=$!
    # setsid runs in the background child (not a group leader) without forking: the pid leads the new group.
    RAY_PGID=$(ps -o pgid= -p "$RAY_PID" 2>/dev/null | tr -d ' ')
    for _ in $(seq 1 20); do [[ "$RAY_PGID" == "$RAY_PID" ]] && break; sleep 0.1
        RAY_PGID=$(ps -o pgid= -p "$RAY_PID" 2>/dev/null | tr -d ' '); done
    [[ "$RAY_PGID" == "$RAY_PID" ]] || RAY_PGID=""  # never signal a group that is not Ray's own
}
ray_log_tail() { echo "--- last lines of this node's Ray output ($1) ---" >&2; tail -n 20 "$RAY_LOG" >&2; }
wait_ray_started() {  # 0 once the node runs; 1 if `ray start` exited (its log then says why)
    while kill -0 "$RAY_PID" 2>/dev/null; do
        grep -q "Ray runtime started" "$RAY_LOG" && return 0
        sleep 0.5
    done
    return 1
}
head_answers() { timeout 3 bash -c "exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT" 2>/dev/null; }

if [[ "$CURRENT_IP" == "$MASTER_ADDR" ]]; then
    # ---- head ----
    if head_answers; then
        echo "error: $MASTER_ADDR:$MASTER_PORT is already in use (another Ray head?); choose another MASTER_PORT" >&2
        exit 1
    fi
    echo "starting the Ray head at $MASTER_ADDR:$MASTER_PORT with $NPUS_PER_NODE $RESOURCE device(s)"
    start_own_ray --head --port "$MASTER_PORT" --include-dashboard=false
    wait_ray_started || { ray_log_tail "ray start --head failed"; exit 1; }
    # Children run in the background (a SIGTERM to this script is handled at once, not after them) with job
    # control on, so that they keep SIGINT (bash ignores it in background jobs otherwise): cleanup forwards it.
    set -m
    ADDRESS="$MASTER_ADDR:$MASTER_PORT" RESOURCE="$RESOURCE" NNODES="$NNODES" NPUS_PER_NODE="$NPUS_PER_NODE" \
        JOIN_TIMEOUT="$JOIN_TIMEOUT" MASTER_ADDR="$MASTER_ADDR" CURRENT_IP="$CURRENT_IP" NODE_IPS="$NODE_IPS" \
        "$PY" - <<'EOF' &
"""Wait until NNODES nodes with NPUS_PER_NODE devices each are alive; name what is missing."""
import os, sys, time
import ray

env = os.environ
nnodes, per_node, timeout = int(env["NNODES"]), int(env["NPUS_PER_NODE"]), int(env["JOIN_TIMEOUT"])
res, head = env["RESOURCE"], {env["MASTER_ADDR"], env["CURRENT_IP"]}
expected = [ip for ip in env.get("NODE_IPS", "").replace(",", " ").split() if ip not in head]
if env.get("NODE_IPS") and len(expected) != nnodes - 1:
    sys.exit(f"error: NODE_IPS={env['NODE_IPS']!r} names {len(expected)} worker node(s) besides the head, NNODES={nnodes}")
ray.init(address=env["ADDRESS"], logging_level="ERROR", log_to_driver=False)
deadline, last = time.monotonic() + timeout, None
while True:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    ips = sorted(n["NodeManagerAddress"] for n in nodes)
    have = {n["NodeManagerAddress"]: n["Resources"].get(res, 0) for n in nodes}
    devices = sum(have.values())
    if len(nodes) >= nnodes and devices >= nnodes * per_node:
        print(f"all {nnodes} node(s) joined with {devices:g} {res} device(s): {' '.join(ips)}", flush=True)
        break
    msg = f"{len(nodes)} of {nnodes} nodes joined ({devices:g} of {nnodes * per_node} {res} devices): {' '.join(ips)}"
    short = [f"{ip} has {d:g}" for ip, d in sorted(have.items()) if d < per_node]
    msg += f"; fewer than {per_node} {res} on {', '.join(short)}" if short else ""
    missing = [ip for ip in expected if ip not in have]
    msg += f"; missing: {' '.join(missing)}" if missing else ""
    if time.monotonic() >= deadline:
        sys.exit(f"error: within JOIN_TIMEOUT={timeout}s {msg}. Start this script on the missing node(s) with the"
                 f" same MASTER_ADDR/MASTER_PORT (or check their firewall/Ray version)")
    if msg != last:
        print(f"waiting for nodes: {msg}", flush=True)
        last = msg
    time.sleep(2)
ray.shutdown()
EOF
    CHILD_PID=$!; set +m; wait "$CHILD_PID" || exit 1; CHILD_PID=""
    cd "$ROOT"
    set -m
    "$PY" -m mindrl.cli.train --config-name "$CONFIG" "rl_config.ray_address=$MASTER_ADDR:$MASTER_PORT" "$@" &
    CHILD_PID=$!; set +m
    wait "$CHILD_PID"; rc=$?; CHILD_PID=""
    echo "mindrl-train exited with $rc; stopping the Ray head"
    exit "$rc"
else
    # ---- worker ----
    deadline=$(( $(date +%s) + JOIN_TIMEOUT )); attempt=0
    while :; do
        attempt=$((attempt + 1))
        until head_answers; do
            if [[ $(date +%s) -ge $deadline ]]; then
                echo "error: the Ray head at $MASTER_ADDR:$MASTER_PORT did not answer within JOIN_TIMEOUT=${JOIN_TIMEOUT}s" >&2
                exit 1
            fi
            echo "waiting for the Ray head at $MASTER_ADDR:$MASTER_PORT"; sleep 3
        done
        start_own_ray --address "$MASTER_ADDR:$MASTER_PORT"
        if wait_ray_started; then break; fi
        stop_own_ray  # what a failed `ray start` left
        if grep -q "InvalidAuthToken\|AuthenticationError" "$RAY_LOG"; then
            ray_log_tail "join refused"
            echo "error: the head at $MASTER_ADDR:$MASTER_PORT uses Ray token authentication: copy its ~/.ray/auth_token" \
                "to this node (or set RAY_AUTH_TOKEN) and RAY_AUTH_MODE=token" >&2
            exit 1
        fi
        if [[ $(date +%s) -ge $deadline ]]; then
            ray_log_tail "join failed"; echo "error: could not join the Ray head at $MASTER_ADDR:$MASTER_PORT" >&2; exit 1
        fi
        echo "joining $MASTER_ADDR:$MASTER_PORT failed (attempt $attempt); retrying in 5 s"; sleep 5
    done
    echo "joined the Ray cluster at $MASTER_ADDR:$MASTER_PORT as $CURRENT_IP with $NPUS_PER_NODE $RESOURCE device(s);" \
        "the head runs the training"
    gone_since=""
    while kill -0 "$RAY_PID" 2>/dev/null; do
        sleep 2
        if head_answers; then gone_since=""; continue; fi
        now=$(date +%s); gone_since="${gone_since:-$now}"
        if (( now - gone_since >= HEAD_GONE_GRACE )); then
            echo "the head at $MASTER_ADDR:$MASTER_PORT is gone (no answer for ${HEAD_GONE_GRACE}s): stopping this node"
            exit 0  # the EXIT trap stops this node's Ray
        fi
    done
    wait "$RAY_PID"; rc=$?; stop_own_ray  # e.g. agents its raylet left behind
    if ! head_answers; then echo "the head's cluster is gone; this node's Ray has stopped"; exit 0; fi
    ray_log_tail "exited with $rc"; echo "error: this node's Ray exited ($rc) while the head is up" >&2; exit 1
fi
