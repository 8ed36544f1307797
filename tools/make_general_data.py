#!/usr/bin/env python
"""Self-distillation rows for an SFT step: ordinary instructions answered by the untuned model itself (greedy, its own
chat template, ending at its end token), so that a narrow SFT step (the SmolLM2 recipe's arithmetic) also trains the
model to keep answering everything else as it did. No network: the answers come from the local HF checkpoint.

    python tools/make_general_data.py --hf ~/.cache/mindrl/models/smollm2/hf --out OUT/raw/general.json
    python tools/make_general_data.py --hf HF --out OUT/raw/general.json --mix OUT/raw/train.json --repeat 4 \
        --mix-out OUT/raw/sft.json      # + the training rows, each general row 4 times, shuffled

Rows are DeepScaleR's JSON ({"problem", "answer", "solution"}: the instruction, "", the base model's answer), the form
the recipe's SFT preprocessing reads. An answer that runs to --max-new-tokens without the end token is dropped (a cut
answer would teach stopping mid-sentence). None of tools/general_check.py's instructions is among these (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

# ordinary requests of the kinds a chat model gets, asked for briefly: facts, definitions, advice, writing, lists
INSTRUCTIONS = (
    "What is the capital of Japan?",
    "What is the capital of Italy?",
    "What is the capital of Canada?",
    "Who wrote Romeo and Juliet?",
    "Who painted the Mona Lisa?",
    "What is the boiling point of water in degrees Celsius?",
    "How many legs does a spider have?",
    "How many continents are there?",
    "How many hours are there in a day?",
    "What colour do you get when you mix blue and yellow?",
    "What is the chemical symbol for gold?",
    "What is the tallest mountain in the world?",
    "Which ocean is the largest?",
    "What language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?",
    "Which planet is known as the Red Planet?",
    "What do bees make?",
    "What is the main ingredient of guacamole?",
    "What is photosynthesis? Answer in one sentence.",
    "Explain what gravity is in one sentence.",
    "What is a noun? Give a short answer.",
    "Define the word 'generous'.",
    "What does a thermometer measure?",
    "What is the difference between weather and climate? Answer briefly.",
    "Explain what a computer virus is in two sentences.",
    "What is the internet? Answer in one sentence.",
    "Why is the sky blue? Answer briefly.",
    "What is a healthy breakfast? Give one example.",
    "Give me three tips for sleeping better.",
    "How can I save money on groceries? Give two tips.",
    "What should I pack for a day at the beach?",
    "Suggest a name for a pet goldfish.",
    "Give me a quick idea for dinner tonight.",
    "How do I make a cup of tea?",
    "What are two benefits of regular exercise?",
    "How can I stay focused while studying?",
    "Write a haiku about autumn.",
    "Write a short poem about the moon.",
    "Write one sentence describing a sunset.",
    "Write a friendly greeting for a birthday card.",
    "Write a short thank-you note to a teacher.",
    "Describe a cat in one sentence.",
    "Write a slogan for a lemonade stand.",
    "Tell me a short joke.",
    "Write the opening line of a mystery story.",
    "Describe the smell of rain in one sentence.",
    "List three fruits that are red.",
    "Name three musical instruments.",
    "List four animals that live in the ocean.",
    "Name three colours of the rainbow.",
    "List three countries in Africa.",
    "Name two famous scientists.",
    "List three things you can find in a kitchen.",
    "Name three sports played with a ball.",
    "Translate 'good morning' into French.",
    "Translate 'cat' into German.",
    "What is the opposite of 'hot'?",
    "Give a synonym for 'happy'.",
    "What is the plural of 'mouse'?",
    "Correct the grammar: 'She go to school every day.'",
    "Rewrite this sentence more politely: 'Give me the book.'",
    "Summarise in one sentence: 'The town built a new library. It has many books and a reading room for children.'",
    "Is a tomato a fruit or a vegetable?",
    "Is the sun a star?",
    "Can penguins fly?",
    "What do you call a baby dog?",
    "What do you call a group of lions?",
    "What is the largest animal on Earth?",
    "What is the fastest land animal?",
    "Where do polar bears live?",
    "What is the longest river in the world?",
    "In which country are the pyramids of Giza?",
    "What is the hardest natural substance?",
    "What organ pumps blood through the body?",
    "What vitamin do we get from sunlight?",
    "What is the smallest prime number?",
    "How many sides does a triangle have?",
    "How many minutes are there in an hour?",
    "What shape has four equal sides and four right angles?",
    "Who was the first person to walk on the Moon?",
)


def _check_apart() -> None:
    from tools.general_check import INSTRUCTIONS as CHECK

    shared = {q for q, _ in CHECK} & set(INSTRUCTIONS)
    if shared:
        raise SystemExit(f"error: make_general_data.py shares instructions with general_check.py: {sorted(shared)}")


def generate(hf: str, max_new_tokens: int, batch: int = 16) -> list[dict]:
    """The untuned model's greedy answers (transformers, fp32), the ones that end at its end token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = []
    for start in range(0, len(INSTRUCTIONS), batch):
        qs = INSTRUCTIONS[start : start + batch]
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
                 for q in qs]  # fmt: skip
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, ids))
        x = torch.tensor([[pad] * (width - len(p)) + list(p) for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=tok.eos_token_id)  # fmt: skip
        for q, row in zip(qs, out[:, width:].tolist()):
            if tok.eos_token_id not in row:
                continue
            text = tok.decode(row[: row.index(tok.eos_token_id)], skip_special_tokens=True).strip()
            if text:
                rows.append({"problem": q, "answer": "", "solution": text})
    return rows


def mix(train: list[dict], general: list[dict], repeat: int, seed: int) -> list[dict]:
    """The training rows and each general row `repeat` times, shuffled (seeded)."""
    mixed = train + general * repeat
    random.Random(seed).shuffle(mixed)
    return mixed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="the untuned model's HF dir")
    ap.add_argument("--out", required=True, help="where the general rows go (JSON)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--mix", help="training rows (JSON) to mix the general rows into")
    ap.add_argument("--repeat", type=int, default=1, help="times each general row appears in --mix-out")
    ap.add_argument("--mix-out", help="where the shuffled mix goes")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if bool(a.mix) != bool(a.mix_out):
        ap.error("--mix and --mix-out go together")
    if a.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {a.repeat}")
    _check_apart()
    import torch

    from mindrl.launch import threads_from_env

    # one thread unless $MINDRL_WORKER_THREADS says otherwise: on a shared host a second OpenMP thread only spins (this
    # pass took 128 CPU s with one thread and had not finished after 520 with two, at load 25-37)
    torch.set_num_threads(threads_from_env() or 1)
    rows = generate(a.hf, a.max_new_tokens)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=0, ensure_ascii=False)
    print(f"{len(rows)} of {len(INSTRUCTIONS)} instructions answered within {a.max_new_tokens} tokens -> {a.out}")
    if a.mix:
        with open(a.mix) as f:
            train = json.load(f)
        mixed = mix(train, rows, a.repeat, a.seed)
        with open(a.mix_out, "w") as f:
            json.dump(mixed, f, indent=0, ensure_ascii=False)
        print(f"{len(train)} training rows + {len(rows)} x {a.repeat} general rows, shuffled -> {a.mix_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
