"""`mindrl-sampler`: an asynchronous sampler process (docs/async.md) that leases prompts from a trainer over ZeroMQ,
generates with the newest weights the trainer published and sends experiences (the trainer scores them)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

from mindrl.serving.transport import DATA_PORT, SYNC_PORT, TransportTimeout

logger = logging.getLogger("mindrl.sampler")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mindrl-sampler",
        description="Sample for an asynchronous trainer over ZeroMQ (mindrl-train with rl_config.async_mode=bounded "
        "rl_config.async_transport=zmq): lease prompts (sync port), fetch the newest "
        "weights (sync port), generate n responses per prompt, and push each prompt's group of experiences (data "
        "port); the trainer scores them with its rl_config.verifier_function. Runs until the trainer has no prompts left and --idle-exit "
        "seconds pass, or until SIGTERM / Ctrl-C.",
    )
    p.add_argument("--sampler-id", required=True, help="this sampler's name, unique among the trainer's samplers")
    p.add_argument("--host", required=True, help="the trainer's address")
    p.add_argument("--data-port", type=int, default=DATA_PORT)
    p.add_argument("--sync-port", type=int, default=SYNC_PORT)
    p.add_argument("--model", required=True, help="HF model dir: architecture, tokenizer and the starting weights")
    p.add_argument("--data-path", required=True, help="the prompts: a mindrl-preprocess output_prefix with labels")
    p.add_argument("--max-prompt-length", type=int, default=1024, help="as rl_config.max_prompt_length")
    # refused with its reason in main: the trainer scores every response, with the verifiers of its own config
    p.add_argument("--verifier", action="append", default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the rollout engine (default: hf)")
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="prompt i of epoch e is sampled with seeds from (seed, e, i)")
    p.add_argument("--lease-size", type=int, default=1, help="prompts leased per round")
    p.add_argument("--ref-model", default=None, help="HF dir of the reference model (the trainer's reference, in HF "
                   "layout): each experience carries its reference logprobs and the trainer skips its reference pass")  # fmt: skip
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a request or a blocked send may take")
    p.add_argument("--idle-exit", type=float, default=None, help="exit after this many seconds with no prompt")
    return p


def main(argv: list[str] | None = None) -> int:
    from mindrl.cli import fast_exit

    fast_exit()  # no final garbage collection at exit
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verifier:
        parser.error(f"--verifier {' '.join(args.verifier)}: samplers do not score; the trainer scores every response "
                     "with its rl_config.verifier_function (verifier_weight, verifier_timeout)")  # fmt: skip
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    from mindrl.serving.sampler_actor import SamplerSpec, build_sampler
    from mindrl.serving.transport import ZmqSamplerEnd

    spec = SamplerSpec(model=args.model, data_path=args.data_path, max_prompt_length=args.max_prompt_length, n=args.n,
                       max_tokens=args.max_tokens, engine=args.engine,
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed, lease_size=args.lease_size,
                       timeout_s=args.timeout, ref_model=args.ref_model)  # fmt: skip
    end = ZmqSamplerEnd(args.sampler_id, args.host, args.data_port, args.sync_port)
    try:
        sampler, engine, num_prompts = build_sampler(args.sampler_id, end, spec)
    except (KeyError, ValueError, FileNotFoundError) as e:
        end.close()
        print(f"mindrl-sampler: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    logger.info("sampler %s: %d prompts, trainer %s (data %d, sync %d)", args.sampler_id, num_prompts, args.host,
                args.data_port, args.sync_port)  # fmt: skip
    sent, idle_since = 0, time.monotonic()
    try:
        while not stop.is_set():
            try:
                k = sampler.step()
            except TransportTimeout as e:  # the trainer is away (restarting, resuming): keep asking
                logger.warning("sampler %s: %s; retrying", args.sampler_id, e)
                k = 0
            sent += k
            if k:
                idle_since = time.monotonic()
                logger.info("sampler %s: %d groups sent (weights v%s)", args.sampler_id, sent, sampler.version)
            elif args.idle_exit is not None and time.monotonic() - idle_since >= args.idle_exit:
                break
            else:
                stop.wait(0.1)
    except KeyboardInterrupt:
        pass
    finally:
        end.close()
        engine.shutdown()
    logger.info("sampler %s: done, %d groups sent", args.sampler_id, sent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
