"""The pairwise (preference) handler: the chosen / rejected documents, the margin, and the rows it refuses, named by
file and line; the synthetic preference task's held-out problems are disjoint from its training ones."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from mindrl.data.handlers import IGNORE_INDEX, AlpacaStylePairwiseHandler
from mindrl.data.templates import get_template


def test_pair_documents_share_the_prompt_and_mask_it(tokenizer):
    h = AlpacaStylePairwiseHandler(tokenizer, get_template("qwen"))
    enc = h.encode_chunk([{"prompt": "Which is larger: 3 or 8?", "chosen": "8", "rejected": "3"}])
    assert enc.good == [0], enc.bad
    doc = {k: enc.flat[k].tolist() for k in enc.flat}
    assert set(doc) == {"chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "margin"}
    prompt_len = doc["chosen_labels"].count(IGNORE_INDEX)
    assert prompt_len == doc["rejected_labels"].count(IGNORE_INDEX) > 0
    assert doc["chosen_input_ids"][:prompt_len] == doc["rejected_input_ids"][:prompt_len]
    assert doc["chosen_labels"][prompt_len:] == doc["chosen_input_ids"][prompt_len:]
    assert tokenizer.decode(doc["chosen_input_ids"][prompt_len:]).startswith("8<|im_end|>")
    assert tokenizer.decode(doc["rejected_input_ids"][prompt_len:]).startswith("3<|im_end|>")
    assert doc["margin"] == [0.0] and enc.flat["margin"].dtype == np.float32


def test_bad_pairs_are_reported_with_reasons(tokenizer):
    keys = {"prompt": "q", "chosen": "good", "rejected": "bad", "margin": "m"}
    h = AlpacaStylePairwiseHandler(tokenizer, get_template("qwen"), keys)
    rows = [
        {"q": "p", "good": "a", "bad": "b", "m": 0.5},
        {"q": "p", "bad": "b", "m": 0},
        {"q": "p", "good": " ", "bad": "b", "m": 0},
        {"q": "p", "good": "a", "bad": "a", "m": 0},
        {"q": "p", "good": "a", "bad": "b", "m": "1"},
        {"q": "p", "good": "a", "bad": "b"},
        {"q": "p", "good": "a", "bad": "b", "m": float("nan")},
        {"q": "p", "good": "c", "bad": "d", "m": -1},
    ]
    enc = h.encode_chunk(rows)
    assert enc.good == [0, 7]
    assert enc.bad == [
        (1, "missing key 'good' (chosen)"),
        (2, "empty chosen (key 'good')"),
        (3, "chosen and rejected are the same text (keys 'good', 'bad'): the pair carries no preference"),
        (4, "margin (key 'm') must be a finite number, got '1'"),
        (5, "missing key 'm' (margin)"),
        (6, "margin (key 'm') must be a finite number, got nan"),
    ]
    assert enc.flat["margin"].tolist() == [0.5, -1.0]


def test_handler_needs_chosen_and_rejected_roles(tokenizer):
    with pytest.raises(ValueError, match=r"needs map_keys\['rejected'\]"):
        AlpacaStylePairwiseHandler(tokenizer, get_template("qwen"), {"prompt": "q", "chosen": "c"})


def test_preprocess_writes_pairs_and_strict_names_file_and_line(tok_dir, tmp_path):
    from mindrl.data.indexed import IndexedDataset
    from mindrl.data.preprocess import BadRowError, dataset_prefix, preprocess
    from mindrl.data.preprocess_config import PreprocessConfig

    rows = [{"prompt": f"p{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(5)]
    rows[3]["rejected"] = rows[3]["chosen"]
    path = tmp_path / "pref.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    def cfg(out: str = "out", **kw):
        return PreprocessConfig(input=str(path), tokenizer_name_or_path=tok_dir, output_prefix=str(tmp_path / out),
                                handler_name="AlpacaStylePairwiseHandler", prompt_type="qwen", **kw)  # fmt: skip

    report = preprocess(cfg(), log=io.StringIO())
    assert (report.rows_written, report.rows_skipped) == (4, 1)
    assert report.first_skipped[0].line == 4 and "same text" in report.first_skipped[0].reason
    margin = IndexedDataset(dataset_prefix(str(tmp_path / "out"), "margin"))
    assert len(margin) == 4 and margin[0].dtype == np.float32
    with pytest.raises(BadRowError, match=r"bad row 3 \(.*pref\.jsonl, line 4\): chosen and rejected are the same"):
        preprocess(cfg("strict", strict=True), log=io.StringIO())


def test_preference_task_holds_out_disjoint_problems():
    from tools.make_preference_data import make_pairs

    pairs = make_pairs(rows=400, valid_fraction=0.1, seed=0)
    train, valid = pairs[:360], pairs[360:]
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in valid}
    distractors = 0
    for p in pairs:
        a, b = (int(c) for c in p["prompt"] if c.isdigit())
        assert p["chosen"] == f"The answer is \\boxed{{{max(a, b)}}}." and p["rejected"] != p["chosen"]
        distractors += str(min(a, b)) not in p["rejected"]
    assert 0.15 < distractors / len(pairs) < 0.35
