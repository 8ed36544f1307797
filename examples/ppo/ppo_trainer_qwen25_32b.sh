#!/usr/bin/env bash
# Qwen2.5-32B PPO on Ascend A3: actor TP8 + critic on the same 32 NPUs (2 nodes x 16), configs/ppo_qwen25_32b_A3.yaml.
# Run on every node:  NNODES=2 MASTER_ADDR=<head ip> SOCKET_IFNAME=<nic> bash examples/ppo/ppo_trainer_qwen25_32b.sh
# Any other config of the same shape: bash examples/ppo/ppo_trainer_qwen25_32b.sh [CONFIG] [key=value ...]
set -euo pipefail
export NNODES="${NNODES:-2}" NPUS_PER_NODE="${NPUS_PER_NODE:-16}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/../ray_train.sh" "${1:-ppo_qwen25_32b_A3}" "${@:2}"
