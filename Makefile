.PHONY: setup test test-fast lint format bench
setup:
	bash tools/setup_env.sh
test:
	bash tests/run.sh
test-fast:
	bash tests/run.sh -m "not slow"
lint:
	.venv/bin/ruff check mindrl tests tools ckpt_convert
format:
	.venv/bin/ruff format mindrl tests tools ckpt_convert
bench:
	.venv/bin/python tools/bench_convert.py
	.venv/bin/python tools/bench_preprocess.py
	.venv/bin/python tools/bench_rewards.py
	.venv/bin/python tools/bench_reshard.py
	.venv/bin/python tools/bench_rollout.py
