#!/usr/bin/env python
"""The base model's and a tuned model's answers to a few ordinary instructions, side by side, and how far the tuned
model moved from the base on them: KL(base || tuned) per token, estimated on responses sampled from the base.
A guard on general ability after RL on a narrow task (docs/real_model.md). HF checkpoints, transformers, fp32.

    python tools/general_check.py --base ~/.cache/mindrl/models/smollm2/hf --tuned outputs/smollm2/ckpt/grpo_hf
"""

from __future__ import annotations

import argparse
import json
import re
import sys

# (instruction, a pattern a right answer contains)
INSTRUCTIONS = (
    ("What is the capital of France?", r"\bParis\b"),
    ("How many days are there in a week?", r"\b(7|seven) days\b"),  # not any 7: "7+6=13" is no answer
    ("Translate 'thank you' into Spanish.", r"\bgracias\b"),
    ("Name the largest planet in our solar system.", r"\bJupiter\b"),
    ("Which gas do plants take in from the air to make their food?", r"(carbon dioxide|CO2|CO₂)"),
    ("Write one sentence about the ocean.", r"\b(ocean|sea)s?\b"),
)


def _load(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tok, model


def _prompts(tok) -> list[list[int]]:
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q, _ in INSTRUCTIONS
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _generate(tok, model, prompts: list[list[int]], max_new: int, sample: bool, n: int = 1, seed: int = 0):
    """Per prompt, n responses (token ids, ending at the end token or max_new), and (sampled ones only) per response
    the model's log-prob of each of its tokens (fp64 log-softmax of the logits it sampled from)."""
    import torch

    torch.manual_seed(seed)
    ids = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    x = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    kw = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new, pad_token_id=pad,
                             eos_token_id=tok.eos_token_id, return_dict_in_generate=True, output_logits=sample, **kw)  # fmt: skip
    responses, logprobs = [], []
    for i, row in enumerate(out.sequences[:, width:].tolist()):
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        responses.append(row)
        if sample:  # only the base's samples need them (the KL estimate); greedy answers are read, not scored
            logits = torch.stack([step[i] for step in out.logits[: len(row)]]).double()
            logprobs.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(row)[:, None])[:, 0])
    return responses, logprobs


def _logprobs(model, prompts: list[list[int]], responses: list[list[int]], chunk: int = 4):
    """Per (prompt, response), the model's log-prob of each response token: right-padded batches (positions from 0,
    as in a single sequence; the causal mask keeps the padding after a row out of its tokens)."""
    import torch

    out = []
    for start in range(0, len(responses), chunk):
        rows = [p + r for p, r in zip(prompts[start : start + chunk], responses[start : start + chunk])]
        width = max(len(r) for r in rows)
        x = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        with torch.no_grad():
            logits = model(input_ids=x).logits
        for j, (p, r) in enumerate(zip(prompts[start : start + chunk], responses[start : start + chunk])):
            scores = logits[j, len(p) - 1 : len(p) + len(r) - 1].double()
            out.append(torch.log_softmax(scores, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    return out


def check(base: str, tuned: str, max_new: int = 64, samples: int = 4) -> dict:
    import torch

    torch.set_num_threads(1)  # a few short generations: a second thread only waits for the first on shared cores
    tok, base_model = _load(base)
    _, tuned_model = _load(tuned)
    prompts = _prompts(tok)
    answers = {}
    for name, model in (("base", base_model), ("tuned", tuned_model)):
        answers[name] = tok.batch_decode(
            _generate(tok, model, prompts, max_new, sample=False)[0], skip_special_tokens=True
        )
    # the base's log-probs from its own sampling; the tuned model's on the same tokens
    drawn, base_lp = _generate(tok, base_model, prompts, max_new, sample=True, n=samples, seed=0)
    tuned_lp = _logprobs(tuned_model, [prompts[j // samples] for j in range(len(drawn))], drawn)
    total = sum(float((b - t).sum()) for b, t in zip(base_lp, tuned_lp))
    tokens = sum(len(r) for r in drawn)
    rows = []
    for (q, pattern), a, b in zip(INSTRUCTIONS, answers["base"], answers["tuned"]):
        rows.append({"instruction": q, "base": a, "tuned": b, "base_ok": bool(re.search(pattern, a, re.I)),
                     "tuned_ok": bool(re.search(pattern, b, re.I))})  # fmt: skip
    return {
        "kl_per_token": total / max(tokens, 1),
        "kl_tokens": tokens,
        "base_right": sum(r["base_ok"] for r in rows),
        "kept": sum(r["tuned_ok"] for r in rows),
        "total": len(rows),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the base model's HF dir")
    ap.add_argument("--tuned", required=True, help="the tuned model's HF dir")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4, help="base samples per instruction for the KL estimate")
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args(argv)
    result = check(a.base, a.tuned, a.max_new_tokens, a.samples)
    for r in result["rows"]:
        print(f"Q: {r['instruction']}")
        for side in ("base", "tuned"):
            ok = "ok " if r[f"{side}_ok"] else "-- "
            print(f"  {side:5s} {ok}{r[side]!r}")
    print(f"right: base {result['base_right']}/{result['total']}, tuned {result['kept']}/{result['total']}; "
          f"KL(base || tuned) {result['kl_per_token']:.4f} nats/token over {result['kl_tokens']} base-sampled tokens")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
