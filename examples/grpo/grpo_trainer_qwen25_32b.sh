#!/usr/bin/env bash
# Qwen2.5-32B GRPO on Ascend A3 (configs/grpo_qwen25_32b_A3.yaml), 1 node(s) x 16 NPUs.
# Run on every node:  NNODES=1 MASTER_ADDR=<head ip> SOCKET_IFNAME=<nic> bash examples/grpo/grpo_trainer_qwen25_32b.sh
# On two Atlas A2 (910B) nodes of 8: NNODES=2 NPUS_PER_NODE=8 ... grpo_trainer_qwen25_32b.sh grpo_qwen25_32b_A2
set -euo pipefail
export NNODES="${NNODES:-1}" NPUS_PER_NODE="${NPUS_PER_NODE:-16}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/../ray_train.sh" "${1:-grpo_qwen25_32b_A3}" "${@:2}"
