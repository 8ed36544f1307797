"""The mcore2hf output is a working HF checkpoint: transformers and vLLM load it and compute the same
tokens and logprobs as the original model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from mindrl.checkpoint import convert

VLLM_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[2])]
outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, logprobs=0), use_tqdm=False)
res = []
for o in outs:
    c = o.outputs[0]
    res.append({"ids": list(c.token_ids), "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]})
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory, get_pool):
    root = tmp_path_factory.mktemp("export")
    convert.hf2mcore(tiny_models["untied"], str(root / "m"), 2, 2, pool=get_pool())
    convert.mcore2hf(str(root / "m"), str(root / "hf"), pool=get_pool())
    return str(root / "hf")


PROMPTS = [[5, 17, 300, 42, 9], [800, 3, 3, 77]]


def hf_greedy(path: str) -> list[dict]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    res = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        new = out.sequences[0, len(p) :].tolist()
        lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, new)]
        res.append({"ids": new, "logprobs": lps})
    return res


def test_transformers_loads_the_export(tiny_models, exported):
    ours, original = hf_greedy(exported), hf_greedy(tiny_models["untied"])
    assert ours == original
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert (
        tok.convert_tokens_to_ids("<|im_end|>")
        == json.load(open(os.path.join(exported, "config.json")))["eos_token_id"]
    )


@pytest.mark.slow
def test_vllm_loads_the_export(exported, tiny_models):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, exported, json.dumps(PROMPTS)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    vllm_res = json.loads(line[len("RESULT") :])
    ref = hf_greedy(tiny_models["untied"])
    for v, r in zip(vllm_res, ref):
        assert v["ids"] == r["ids"]
        assert max(abs(a - b) for a, b in zip(v["logprobs"], r["logprobs"])) < 1e-4
