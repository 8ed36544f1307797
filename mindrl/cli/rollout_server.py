"""`mindrl-rollout-server`: serve a vLLM rollout engine over HTTP for remote rollouts (docs/rollout_server.md), e.g.
`mindrl-rollout-server --model HF_DIR [--host 127.0.0.1] [--port 8000] [--token-file F]`."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from mindrl.config.settings import RolloutConfig
from mindrl.serving.protocol import read_token
from mindrl.serving.server import DEFAULT_MAX_BODY_MB, LOG_PREFIX, ServerConfig

ENGINE_ARGS = ("infer_tensor_parallel_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "seed",
               "kv_cache_memory_bytes")  # fmt: skip
"""The flags that are RolloutConfig's keys as they are."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mindrl-rollout-server",
        description="Serve a vLLM engine for remote rollouts: /generate (token ids in, token ids + logprobs + "
        "weight version out), versioned atomic weight updates (/weights/*), /v1/completions and /health.",
    )
    p.add_argument("--model", required=True, help="HF model dir; served from its weights as version 0")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (non-loopback needs --token-file)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (default 8000)")
    p.add_argument("--token-file", help="file holding the bearer token clients must send (content stripped)")
    p.add_argument(
        "--tensor-parallel-size",
        dest="infer_tensor_parallel_size",
        type=int,
        default=1,
        help="inference TP: a world of this many engine ranks (child processes) serving as one engine",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas, one child process each; a batch is split across them",
    )
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + response tokens, at most")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences decoded at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="most tokens in one engine step")
    p.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="inference dtype (default: the platform's: float32 where there is no accelerator, else bfloat16)",
    )
    p.add_argument("--seed", type=int, default=1234, help="engine RNG seed (for requests without seeds)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks across requests")
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_MB,
        help=f"largest request body accepted, in MiB (413 above; default {DEFAULT_MAX_BODY_MB:g}: above the "
        "trainer's weight buckets, generate_config.bucket_size_mb)",
    )
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV cache size (default: the platform's)")
    return p


def _default_dtype() -> str:
    from mindrl.platform import current_platform

    return "float32" if current_platform().is_cpu else "bfloat16"


def _stop(signum, frame) -> None:
    # Until uvicorn takes over the signals (and after it gives them back), a SIGTERM must still unwind
    # through the engine shutdown below rather than kill the process outright.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from mindrl.cli import fast_exit

    fast_exit()  # no final garbage collection at exit
    args = build_parser().parse_args(argv)
    token = None
    if args.token_file:
        try:
            token = read_token(args.token_file)
        except ValueError as e:
            print(f"{LOG_PREFIX} error: --token-file: {e}", file=sys.stderr)
            return 2
    try:
        engine = RolloutConfig(
            **{key: getattr(args, key) for key in ENGINE_ARGS},
            model=args.model,
            load_format="auto",
            dtype=args.dtype or _default_dtype(),
            enable_prefix_caching=not args.no_prefix_caching,
        )
        config = ServerConfig(
            engine,
            host=args.host,
            port=args.port,
            token=token,
            data_parallel_size=args.data_parallel_size,
            max_body_mb=args.max_body_mb,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from mindrl.serving.server import RolloutServer, bind

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        sock = bind(config.host, config.port)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = None
    try:
        print(f"{LOG_PREFIX} loading {config.model} ...", flush=True)
        server = RolloutServer(config)
        asyncio.run(server.serve(sock))
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the engine shutdown short
            signal.signal(sig, signal.SIG_IGN)
        sock.close()
        if server is not None:
            server.close()
        print(f"{LOG_PREFIX} stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
