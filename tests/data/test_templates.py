"""Chat templates: the exact qwen_r1 text, every shipped template, special tokens, unknown names."""

from __future__ import annotations

import json

import pytest

from mindrl.data.templates import UnknownTemplateError, get_template, load_templates

R1_INSTRUCTION = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning "
    "process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> "
    "reasoning process here </think><answer> answer here </answer>. Put your final answer within \\boxed{}."
)


def test_qwen_r1_renders_exactly_the_required_text():
    p = "What is $\\frac{1}{2} + {x}$?"
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        + R1_INSTRUCTION
        + "\n"
        + p
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert get_template("qwen_r1").render_prompt(p) == expected


def test_special_tokens_tokenise_to_single_ids(tokenizer):
    text = get_template("qwen_r1").render_prompt("P")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == start
    assert ids[-1] != end and ids.count(start) == 3 and ids.count(end) == 2
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "name, expected",
    [
        ("default", "Human: P\nAssistant:"),
        ("empty", "P"),
        (
            "qwen",
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "qwen_math_r1",
            "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
            "<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n",
        ),
        ("qwen3", "<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        (
            "smollm2",
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "llama3",
            "<s><|start_header_id|>user<|end_header_id|>\n\nP<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        ("deepseek3_r1", "<s>" + R1_INSTRUCTION + " <｜User｜>P<｜Assistant｜>"),
    ],
)
def test_each_template_with_default_system(name, expected):
    assert get_template(name).render_prompt("P", bos_token="<s>", eos_token="</s>") == expected


def test_row_system_replaces_default_and_empty_system_uses_default():
    t = get_template("qwen")
    assert t.render_prompt("P", system="Be brief.").startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert t.render_prompt("P", system="") == t.render_prompt("P")
    assert (
        get_template("llama3")
        .render_prompt("P", system="S")
        .startswith("<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>")
    )


def test_placeholders_inside_content_stay_literal():
    # A prompt may itself contain "{content}" or "{eos_token}": it must come out unchanged.
    t = get_template("qwen")
    assert "x {eos_token} {content} y" in t.render_prompt("x {eos_token} {content} y", eos_token="</s>")
    assert t.render_response("42") == "42<|im_end|>\n"
    assert get_template("default").render_response("42", eos_token="</s>") == "42</s>"


def test_qwen3_thinking_off_as_mindspeed_rl():
    """MindSpeed-RL's qwen3 (ReasoningTemplate, thinking off in its prompt and SFT handlers): thoughts leave the
    response, and the prompt ends with an empty thought unless what is left of the response still has a marker."""
    t = get_template("qwen3")
    head = "<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n"
    assert t.thought_words == ("<think>", "</think>") and t.empty_thought == "<think>\n\n</think>\n\n"
    assert t.render_prompt("P", response="42") == head + "<think>\n\n</think>\n\n"
    assert t.render_prompt("P", response="<think>a\nb</think>\n\n42") == head + "<think>\n\n</think>\n\n"
    assert t.render_prompt("P", response="<think> unfinished") == head  # a marker stays: no empty thought added
    assert t.render_response("<think>a\nb</think>\n\n42") == "42<|im_end|>\n"
    assert t.render_response("x <think>a</think> y") == "x  y<|im_end|>\n"
    assert get_template("qwen").render_response("<think>a</think>42") == "<think>a</think>42<|im_end|>\n"


def test_thought_words_must_be_two_strings(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"r": {"user": "{content}", "thought_words": ["<think>"]}}')
    with pytest.raises(ValueError, match="template 'r' field 'thought_words' must be a list of two non-empty"):
        load_templates(str(path))


def test_required_templates_are_shipped():
    assert {"default", "empty", "qwen", "qwen_r1", "qwen_math_r1", "qwen3", "smollm2", "llama3", "deepseek3_r1"} <= set(
        load_templates()
    )


def test_unknown_prompt_type_lists_known_and_close_matches():
    with pytest.raises(UnknownTemplateError) as e:
        get_template("qwen_r2")
    msg = str(e.value)
    assert "unknown prompt_type 'qwen_r2'" in msg and "'qwen_r1'" in msg and "deepseek3_r1" in msg and "llama3" in msg


def test_bad_templates_file_is_rejected(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"x": {"user": "no placeholder"}}))
    with pytest.raises(ValueError, match="lacks the \\{content\\} placeholder"):
        get_template("x", str(p))
    p.write_text(json.dumps({"x": {"user": "{content}", "colour": "red"}}))
    with pytest.raises(ValueError, match="unknown field"):
        get_template("x", str(p))
