"""What the driver's process imports: mindrl-train's driver, preflight, the config, the planner, the worker classes and
the driver's tokenizer once loaded and used, load neither vLLM nor megatron-core nor torch._dynamo (which megatron-core
and transformers' auto model classes pull in: ~0.2 GiB) nor math-verify / sympy (the verifiers' processes do)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.trainer.rl_helpers import ROOT

_PROBE = """
import json, sys
import mindrl.cli.train, mindrl.cli.plan, mindrl.preflight, mindrl.trainer.ppo_trainer, mindrl.plan
import mindrl.trainer.leftovers, mindrl.workers.integrated_worker, mindrl.workers.critic_worker
from mindrl.trainer.reward_client import RewardClient
from mindrl.data.tokenizer import load_tokenizer
from mindrl.workers.from_config import end_token_ids
tok = load_tokenizer(sys.argv[1])
assert end_token_ids(tok) and tok.batch_decode([tok("1 + 1 = 2")["input_ids"]]) == ["1 + 1 = 2"]
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", "math_verify", "sympy", "vllm")
                        or m == "torch._dynamo")))
"""


def test_the_driver_imports_no_megatron_nor_math_verify(tiny_models):
    out = subprocess.run([sys.executable, "-c", _PROBE, tiny_models["untied"]], capture_output=True, text=True,
                         cwd=ROOT, check=True)  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
