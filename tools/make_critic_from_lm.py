#!/usr/bin/env python
"""Turn an HF causal LM into a critic / value-model HF checkpoint: the same trunk with a 1-output score head
(`*ForSequenceClassification`, num_labels=1), ready for `mindrl-convert hf2mcore --orm`.

PPO's critic is usually initialised from a reward model; without one (the quickstart, a first experiment)
the policy's own trunk with a zero head (every value starts at 0) is the common choice.

    python tools/make_critic_from_lm.py --hf-dir ./outputs/quickstart/hf_sft --out ./outputs/quickstart/hf_critic
"""

from __future__ import annotations

import argparse
import os
import sys


def make_critic(hf_dir: str, out: str, head_std: float = 0.0, seed: int = 0) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(hf_dir)
    arch = (config.architectures or ["?"])[0]
    if not arch.endswith("ForCausalLM"):
        raise ValueError(f"{hf_dir}: expected a *ForCausalLM checkpoint, found {arch}")
    lm = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config.architectures = [arch.replace("ForCausalLM", "ForSequenceClassification")]
    config.num_labels = 1
    config.tie_word_embeddings = False
    critic = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    critic.model.load_state_dict(lm.model.state_dict(), strict=True)
    with torch.no_grad():
        if head_std > 0:
            critic.score.weight.normal_(0.0, head_std, generator=torch.Generator().manual_seed(seed))
        else:
            critic.score.weight.zero_()
    os.makedirs(out, exist_ok=True)
    critic.save_pretrained(out)
    try:
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out)
    except (OSError, ValueError):  # a model dir without a tokenizer is fine
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hf-dir", required=True, help="HF causal LM directory (e.g. the SFT model)")
    p.add_argument("--out", required=True, help="output directory for the *ForSequenceClassification checkpoint")
    p.add_argument("--head-std", type=float, default=0.0, help="init std of the value head (0: zeros)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        print(make_critic(args.hf_dir, args.out, args.head_std, args.seed))
    except (ValueError, OSError) as e:
        print(f"make_critic_from_lm: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
