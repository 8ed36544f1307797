"""What the agentic task generators (make_retool_data.py, make_search_data.py) share: the agent loop's text after a
tool call, and writing the SFT / RL splits and the tool config the recipes read."""

from __future__ import annotations

import json
import os

import yaml

# The agent loop's ChatFormat (mindrl.trainer.pipeline.agent_loop): what follows a turn that called a tool.
OBSERVATION = (
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n{out}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


def write_task(out: str, sft: list[dict], rl: list[dict], tool_config: dict) -> None:
    """OUT/sft.json and OUT/rl.json (DeepScaleR's JSON list of rows, for mindrl-sft and preprocessing) and
    OUT/tools.yaml (for rl_config.tool_config_path); `out` is created if missing."""
    os.makedirs(out, exist_ok=True)
    for name, rows in (("sft", sft), ("rl", rl)):
        with open(os.path.join(out, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    with open(os.path.join(out, "tools.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(tool_config, f, sort_keys=False)
