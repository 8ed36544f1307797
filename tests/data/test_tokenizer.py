"""`mindrl.data.tokenizer.load_tokenizer` gives what AutoTokenizer gives (class, special tokens, ids, text) and falls
back to AutoTokenizer where the config names no class transformers exports."""

from __future__ import annotations

import json
import os
import shutil

from mindrl.data.tokenizer import load_tokenizer, named_tokenizer_class

TEXTS = ["Hello world", "<|im_start|>user\n12 + 7 = ?<|im_end|>\n", "  spaces\tand\nnew lines ", "ünïcödé 数字 42"]


def _same(a, b) -> None:
    assert type(a) is type(b)
    for key in ("eos_token_id", "pad_token_id", "unk_token_id", "bos_token_id"):
        assert getattr(a, key) == getattr(b, key), key
    assert a.get_vocab() == b.get_vocab()
    assert a.convert_tokens_to_ids("<|im_end|>") == b.convert_tokens_to_ids("<|im_end|>")
    for text in TEXTS:
        ids = a(text)["input_ids"]
        assert ids == b(text)["input_ids"], text
        for skip in (False, True):
            assert a.decode(ids, skip_special_tokens=skip) == b.decode(ids, skip_special_tokens=skip)


def test_the_named_class_is_autotokenizers_choice(tok_dir, tiny_models):
    from transformers import AutoTokenizer

    for path in (tok_dir, tiny_models["untied"], tiny_models["tied"]):
        assert named_tokenizer_class(path) is not None
        _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


def test_falls_back_to_autotokenizer(tok_dir, tmp_path):
    from transformers import AutoTokenizer

    for name, edit in (("unknown", {"tokenizer_class": "NoSuchTokenizer"}), ("none", {"tokenizer_class": None})):
        path = str(tmp_path / name)
        shutil.copytree(tok_dir, path)
        cfg_path = os.path.join(path, "tokenizer_config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg.update(edit)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        assert named_tokenizer_class(path) is None
        _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path))
