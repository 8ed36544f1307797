"""Handlers: what input_ids and labels hold for each one, and why a row is skipped."""

from __future__ import annotations

import pytest

from mindrl.data.handlers import (
    IGNORE_INDEX,
    AlpacaStyleInstructionHandler,
    GSM8KStyleInstructionHandler,
    R1AlpacaStyleInstructionHandler,
    get_handler_class,
)
from mindrl.data.templates import get_template

DEEPSCALER_KEYS = {"prompt": "problem", "query": "", "response": "answer", "system": ""}


def _one(handler, row):
    enc = handler.encode_chunk([row])
    assert enc.good == [0], enc.bad
    return {k: enc.flat[k].tolist() for k in enc.flat}


def test_r1_handler_prompt_and_labels(tokenizer):
    h = R1AlpacaStyleInstructionHandler(tokenizer, get_template("qwen_r1"), DEEPSCALER_KEYS, ["labels"])
    row = {"problem": "Find $\\frac{3}{4}$ of 8.", "answer": " 6 ", "solution": "...", "level": 1}
    out = _one(h, row)
    assert tokenizer.decode(out["input_ids"]) == get_template("qwen_r1").render_prompt(row["problem"])
    assert out["attention_mask"] == [1] * len(out["input_ids"])
    assert tokenizer.decode(out["labels"]) == "6"


def test_labels_never_contain_special_ids(tokenizer):
    h = R1AlpacaStyleInstructionHandler(tokenizer, get_template("qwen"), DEEPSCALER_KEYS, ["labels"])
    out = _one(h, {"problem": "p", "answer": "a<|im_end|>b"})
    assert not set(out["labels"]) & set(tokenizer.all_special_ids)
    assert tokenizer.decode(out["labels"]) == "a<|im_end|>b"


def test_query_follows_prompt_and_row_system_is_used(tokenizer):
    keys = {"prompt": "instruction", "query": "input", "response": "output", "system": "sys"}
    h = R1AlpacaStyleInstructionHandler(tokenizer, get_template("qwen"), keys)
    out = _one(h, {"instruction": "Add:", "input": "1 2", "output": "3", "sys": "Be brief."})
    assert tokenizer.decode(out["input_ids"]) == get_template("qwen").render_prompt("Add:\n1 2", "Be brief.")


def test_alpaca_handler_masks_the_prompt(tokenizer):
    h = AlpacaStyleInstructionHandler(tokenizer, get_template("qwen"))  # default keys: instruction/input/output
    out = _one(h, {"instruction": "Say hi", "input": "", "output": "hi"})
    prompt_ids = tokenizer(get_template("qwen").render_prompt("Say hi"), add_special_tokens=False)["input_ids"]
    n = len(prompt_ids)
    assert out["input_ids"][:n] == prompt_ids
    assert tokenizer.decode(out["input_ids"][n:]) == "hi<|im_end|>\n"
    assert out["labels"][:n] == [IGNORE_INDEX] * n
    assert out["labels"][n:] == out["input_ids"][n:]
    assert out["input_ids"][n:].count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1


def test_gsm8k_handler_takes_the_answer_after_hashes(tokenizer):
    h = GSM8KStyleInstructionHandler(tokenizer, get_template("qwen_r1"), additional_keys=["labels"])
    out = _one(h, {"question": "How many?", "answer": "3 + 4 = <<3+4=7>>7 ... #### 1,207"})
    assert tokenizer.decode(out["labels"]) == "1207"
    assert tokenizer.decode(out["input_ids"]).endswith("How many?<|im_end|>\n<|im_start|>assistant\n")
    enc = h.encode_chunk([{"question": "q", "answer": "no marker"}, {"question": "q", "answer": "x ####  "}])
    assert enc.good == [] and [r for _, r in enc.bad] == [
        "no '####' answer marker in key 'answer'",
        "empty answer after '####' in key 'answer'",
    ]


def test_bad_rows_are_reported_with_reasons_and_good_rows_kept_in_order(tokenizer):
    h = R1AlpacaStyleInstructionHandler(tokenizer, get_template("qwen_r1"), DEEPSCALER_KEYS, ["labels"])
    rows = [
        {"problem": "ok 1", "answer": "1"},
        {"answer": "1"},
        {"problem": None, "answer": "1"},
        {"problem": "p", "answer": 7},
        {"problem": " \n", "answer": "1"},
        {"problem": "p", "answer": ""},
        ["not", "a", "dict"],
        {"problem": "ok 2", "answer": "2"},
    ]
    enc = h.encode_chunk(rows)
    assert enc.good == [0, 7]
    assert enc.bad == [
        (1, "missing key 'problem' (prompt)"),
        (2, "null value for key 'problem' (prompt)"),
        (3, "non-string value for key 'answer' (response): int"),
        (4, "empty prompt (key 'problem')"),
        (5, "empty response (key 'answer')"),
        (6, "row is not an object but list"),
    ]
    assert enc.lengths["labels"].tolist() == [1, 1]
    assert tokenizer.decode(enc.flat["labels"].tolist()) == "12"


def test_additional_raw_keys_are_tokenised(tokenizer):
    h = R1AlpacaStyleInstructionHandler(tokenizer, get_template("qwen_r1"), DEEPSCALER_KEYS, ["labels", "solution"])
    enc = h.encode_chunk([{"problem": "p", "answer": "1", "solution": "because"}, {"problem": "p", "answer": "1"}])
    assert enc.good == [0] and enc.bad == [(1, "missing key 'solution' (dataset_additional_keys)")]
    assert tokenizer.decode(enc.flat["solution"].tolist()) == "because"


def test_unknown_handler_names_close_matches():
    with pytest.raises(ValueError) as e:
        get_handler_class("R1AlpacaStyleInstructionHandlr")
    assert "'R1AlpacaStyleInstructionHandler'" in str(e.value) and "GSM8KStyleInstructionHandler" in str(e.value)


def test_given_map_keys_replace_defaults_and_need_prompt_and_response(tokenizer):
    h = R1AlpacaStyleInstructionHandler(tokenizer, get_template("qwen"), {"prompt": "q", "response": "a"})
    assert h.map_keys == {"prompt": "q", "query": "", "response": "a", "system": ""}
    assert _one(h, {"q": "p", "a": "1"})  # no 'input' or 'system' field needed
    with pytest.raises(ValueError, match=r"needs map_keys\['response'\]"):
        R1AlpacaStyleInstructionHandler(tokenizer, get_template("qwen"), {"prompt": "q"})


def test_alpaca_handler_trains_a_tool_use_trace_only_on_what_the_model_writes(tokenizer):
    """A response holding an agent's trace (its tool call, the `<tool_response>` user turn that answers it, then its
    answer; tools/make_retool_data.py's SFT rows): the user turn is context (IGNORE_INDEX), as the agent loop's
    observation is out of the RL loss; every other response token is trained, and input_ids are the plain
    tokenisation."""
    from tools._task_data import OBSERVATION

    call = '<tool_call>\n{"name": "code", "arguments": {"code": "print(12*34)"}}\n</tool_call>'
    trace = call + OBSERVATION.format(out="408\n") + "The answer is \\boxed{408}."
    h = AlpacaStyleInstructionHandler(tokenizer, get_template("qwen"))
    out = _one(h, {"instruction": "What is 12 * 34?", "input": "", "output": trace})
    prompt = get_template("qwen").render_prompt("What is 12 * 34?")
    whole = prompt + get_template("qwen").render_response(trace)
    assert out["input_ids"] == tokenizer(whole, add_special_tokens=False)["input_ids"]
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids, labels = out["input_ids"][n:], out["labels"][n:]
    trained = tokenizer.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    context = tokenizer.decode([t for t, lab in zip(ids, labels) if lab == IGNORE_INDEX])
    assert context == "<|im_start|>user\n<tool_response>\n408\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert trained == call + "<|im_end|>\n" + "The answer is \\boxed{408}.<|im_end|>\n"
    assert all(lab in (t, IGNORE_INDEX) for t, lab in zip(ids, labels))
    masked = [lab == IGNORE_INDEX for lab in labels]
    first = masked.index(True)  # the user turn: one block
    assert masked[first : first + masked.count(True)] == [True] * masked.count(True)
