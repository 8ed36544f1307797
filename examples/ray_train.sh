#!/usr/bin/env bash
# Start (or join) a Ray cluster across NNODES hosts and run mindrl-train on the head node. Every node runs this
# same script with the same settings; the one whose address is MASTER_ADDR becomes the head.
#   bash examples/ray_train.sh CONFIG_NAME [key=value ...]
# Settings (environment):
#   NNODES (1)  NPUS_PER_NODE (16)  MASTER_ADDR (127.0.0.1)  MASTER_PORT (6379)  SOCKET_IFNAME (network interface
#   whose address is this node's CURRENT_IP; default: the first address of `hostname -I`)  JOIN_TIMEOUT (600 s)
# On Ascend, source CANN's set_env.sh first. jemalloc is preloaded when its library exists.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    [[ $# -lt 1 ]] && exit 2 || exit 0
fi
CONFIG="$1"; shift
NNODES="${NNODES:-1}"; NPUS_PER_NODE="${NPUS_PER_NODE:-16}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"; MASTER_PORT="${MASTER_PORT:-6379}"; JOIN_TIMEOUT="${JOIN_TIMEOUT:-600}"
PY="python"; [[ -x "$ROOT/.venv/bin/python" ]] && PY="$ROOT/.venv/bin/python"
RAY="$(dirname "$(command -v "$PY")")/ray"; [[ -x "$RAY" ]] || RAY=ray

if [[ -n "${SOCKET_IFNAME:-}" ]]; then
    CURRENT_IP=$(ip -4 addr show "$SOCKET_IFNAME" 2>/dev/null | awk '/inet /{print $2}' | cut -d/ -f1 | head -1)
    [[ -n "$CURRENT_IP" ]] || { echo "error: SOCKET_IFNAME=$SOCKET_IFNAME has no IPv4 address" >&2; exit 2; }
else
    CURRENT_IP=$( (hostname -I 2>/dev/null || echo 127.0.0.1) | awk '{print $1}')
fi
[[ "$NNODES" -eq 1 ]] && CURRENT_IP="$MASTER_ADDR"
if [[ "$NNODES" -gt 1 ]]; then
    for v in MASTER_ADDR CURRENT_IP; do
        case "${!v}" in 127.*|localhost|::1) echo "error: $v=${!v} is a loopback address but NNODES=$NNODES:" \
            "set MASTER_ADDR to the head's address and SOCKET_IFNAME to the interface the nodes share" >&2; exit 2;; esac
    done
fi
for lib in /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 /usr/local/lib/libjemalloc.so.2; do
    if [[ -f "$lib" ]]; then export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"; break; fi
done
RESOURCE=$(cd "$ROOT" && "$PY" -c "from mindrl.platform import current_platform as p; print(p().ray_resource)")
case "$RESOURCE" in
    GPU) DEVICES=(--num-gpus "$NPUS_PER_NODE");;
    NPU) DEVICES=(--resources "{\"NPU\": $NPUS_PER_NODE}");;
    *)   DEVICES=(--num-cpus "$NPUS_PER_NODE");;
esac

if [[ "$CURRENT_IP" == "$MASTER_ADDR" ]]; then
    "$RAY" start --head --node-ip-address "$MASTER_ADDR" --port "$MASTER_PORT" --include-dashboard=false "${DEVICES[@]}"
    deadline=$(( $(date +%s) + JOIN_TIMEOUT ))
    while :; do
        joined=$("$PY" -c "import ray; ray.init(address='auto', logging_level='ERROR'); print(' '.join(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))")
        count=$(wc -w <<<"$joined")
        [[ "$count" -ge "$NNODES" ]] && break
        if [[ $(date +%s) -ge $deadline ]]; then
            echo "error: $count of $NNODES nodes joined within ${JOIN_TIMEOUT}s (joined: $joined); start this script on the others" >&2
            exit 1
        fi
        echo "waiting for nodes: $count/$NNODES joined ($joined)"; sleep 5
    done
    cd "$ROOT"
    exec "$PY" -m mindrl.cli.train --config-name "$CONFIG" rl_config.ray_address=auto "$@"
else
    for attempt in $(seq 1 30); do
        if "$RAY" start --address "$MASTER_ADDR:$MASTER_PORT" --node-ip-address "$CURRENT_IP" "${DEVICES[@]}"; then
            echo "joined the Ray cluster at $MASTER_ADDR:$MASTER_PORT; the head runs the training"; exit 0
        fi
        echo "head not reachable yet (attempt $attempt/30); retrying in 10 s"; sleep 10
    done
    echo "error: could not join the Ray head at $MASTER_ADDR:$MASTER_PORT" >&2; exit 1
fi
