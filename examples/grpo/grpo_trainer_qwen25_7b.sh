#!/usr/bin/env bash
# Qwen2.5-7B GRPO on Ascend A3 (configs/grpo_qwen25_7b_A3.yaml), 1 node(s) x 16 NPUs.
# Run on every node:  NNODES=1 MASTER_ADDR=<head ip> SOCKET_IFNAME=<nic> bash examples/grpo/grpo_trainer_qwen25_7b.sh
set -euo pipefail
export NNODES="${NNODES:-1}" NPUS_PER_NODE="${NPUS_PER_NODE:-16}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/../ray_train.sh" "${1:-grpo_qwen25_7b_A3}" "${@:2}"
