"""tools/check_hybrid_engine.py as users run it: one command, its own ranks, a JSON last line, exit codes."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tools.check_hybrid_engine import main


def test_bad_arguments_exit_before_starting_ranks(tiny_models, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--hf-dir", tiny_models["untied"], "--tp", "2", "--infer-tp", "3"])
    assert e.value.code == 2 and "--infer-tp 3 must divide the number of ranks TP*PP = 2" in capsys.readouterr().err
    assert main(["--hf-dir", tiny_models["orm"]]) == 2
    assert "is a value model" in capsys.readouterr().err
    assert main(["--hf-dir", tiny_models["untied"], "--tp", "3"]) == 2
    assert "TP=3 does not divide" in capsys.readouterr().err


@pytest.mark.slow
def test_one_command_on_a_dir_without_tokenizer(tiny_models, tmp_path, capsys):
    hf = tmp_path / "weights_only"
    hf.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_models["tied"], f), hf / f)
    rc = main(["--hf-dir", str(hf), "--tp", "1", "--pp", "2", "--infer-tp", "2", "--steps", "1", "--cycles", "2",
               "--num-prompts", "2", "--max-tokens", "8"])  # fmt: skip
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and summary["reshard_matches_export"] and summary["logprob_diff_max"] < 1e-4
    for key in ("logprob_diff_mean", "reshard_s", "memcpy_s", "peak_extra_bytes", "rollout_tokens_per_s"):
        assert summary[key] >= 0
