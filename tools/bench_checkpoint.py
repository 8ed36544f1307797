"""Save and load times and sizes of a training checkpoint (model + optimizer + scheduler/RNG), as `mindrl-train`
writes it every `save_interval`, for the tiny test model and a ~30M-parameter one, at a few layouts.

    python tools/bench_checkpoint.py                       # tiny and 30M, TP1 and TP2, 3 repeats (medians)
    python tools/bench_checkpoint.py --models 30m --layouts 2x1 --repeats 5

Each rank builds the model and megatron's optimizer from an HF->mcore conversion, takes one Adam step (so the
optimizer state exists), then: save (`save_train_state`, timed on the slowest rank), and load into a freshly
built model + optimizer as a resuming worker does (`build_model_and_optimizer` from the saved iteration, which
loads the weights, then `load_train_state`; both timed, the first reported as "build+weights"). The load is checked: parameters and Adam moments equal the saved ones bit for bit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "tiny": [],  # tools/make_tiny_model.py defaults (the tests' model)
    # hidden 512, 8 layers, 8 heads / 4 kv heads, FFN 1408, vocab 8192, untied: 32.0M parameters
    "30m": ["--hidden-size", "512", "--num-layers", "8", "--num-heads", "8", "--num-kv-heads", "4",
            "--intermediate-size", "1408", "--vocab-size", "8192"],
}  # fmt: skip


def _state(model, optimizer):
    import torch

    from mindrl.resharding.stream import unwrap

    params = {k: v.detach().clone() for k, v in unwrap(model).state_dict().items() if torch.is_tensor(v)}
    moments = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for st in opt.optimizer.state.values():
            moments += [st[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in st]
    return params, moments


def _rank_bench(load_dir: str, tp: int, pp: int, out_dir: str) -> dict:
    """On every rank: build, one step, save (timed), rebuild, load (timed), compare."""
    import torch

    from mindrl.checkpoint import mcore_ckpt
    from mindrl.checkpoint.train_state import load_train_state, save_train_state
    from mindrl.launch import init_model_parallel
    from mindrl.workers.settings import ModelSettings
    from mindrl.workers.train_setup import OptimSettings, build_model_and_optimizer, train_steps

    init_model_parallel(tp, pp)
    optim = OptimSettings(lr=1e-4)
    spec, model, optimizer, scheduler = build_model_and_optimizer(load_dir, tp, pp, optim, 10)
    train_steps(model, optimizer, spec.vocab_size, steps=1, seed=0, batch=2, seq=16)  # creates Adam's state
    scheduler.step(1)
    saved = _state(model, optimizer)
    rank = torch.distributed.get_rank()
    it_dir = mcore_ckpt.iteration_dir(out_dir, 1)
    if rank == 0:
        os.makedirs(it_dir, exist_ok=True)
    torch.distributed.barrier()
    settings = ModelSettings(load=load_dir, tp=tp, pp=pp, optim=optim)
    t0 = time.perf_counter()
    save_train_state(model, optimizer, scheduler, spec, "actor", settings, it_dir, True, True)
    save_s = time.perf_counter() - t0
    if rank == 0:
        mcore_ckpt.write_tracker(out_dir, 1)
    torch.distributed.barrier()
    # What a resuming worker does: build the model from the saved iteration, then restore the rest.
    t0 = time.perf_counter()
    _, model2, optimizer2, scheduler2 = build_model_and_optimizer(out_dir, tp, pp, optim, 10)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    load_train_state(model2, optimizer2, scheduler2, it_dir, True, True)
    torch.distributed.barrier()
    load_s = time.perf_counter() - t0
    params, moments = _state(model2, optimizer2)
    exact = (
        all(params[k].equal(v) for k, v in saved[0].items())
        and all(a.equal(b) for a, b in zip(saved[1], moments))
        and len(moments) == len(saved[1])
    )
    n = sum(p.numel() for p in model.parameters())
    return {"save_s": save_s, "build_s": build_s, "load_s": load_s, "exact": exact, "local_params": n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--layouts", nargs="+", default=["1x1", "2x1"], help="TPxPP, e.g. 2x1 1x2")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per case (medians are reported)")
    p.add_argument("--workdir", default=None, help="where models and checkpoints go (default: a temp dir)")
    args = p.parse_args(argv)

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)  # the ranks unpickle the function by module name
    from mindrl.checkpoint.mcore_ckpt import dir_nbytes
    from mindrl.launch import RankPool
    from tools.bench_checkpoint import _rank_bench

    work = args.workdir or tempfile.mkdtemp(prefix="bench_ckpt_")
    rows = []
    try:
        for name in args.models:
            hf, mc = os.path.join(work, name, "hf"), os.path.join(work, name, "mcore")
            if not os.path.isdir(mc):
                subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_tiny_model.py"), "--out", hf,
                                *MODELS[name]], check=True, capture_output=True)  # fmt: skip
                subprocess.run([sys.executable, "-m", "mindrl.cli.convert", "hf2mcore", "--hf-dir", hf, "--save-dir",
                                mc], check=True, capture_output=True)  # fmt: skip
            for layout in args.layouts:
                tp, pp = (int(x) for x in layout.lower().split("x"))
                pool = RankPool(tp * pp)
                try:
                    runs = []
                    for r in range(args.repeats):
                        out = os.path.join(work, name, f"ckpt_{layout}_{r}")
                        shutil.rmtree(out, ignore_errors=True)
                        res = pool.run(_rank_bench, mc, tp, pp, out)
                        runs.append((res, dir_nbytes(out)))
                        print(f"[bench_checkpoint] {name} TP{tp}xPP{pp} repeat {r + 1}/{args.repeats}", flush=True)
                finally:
                    pool.close()
                med = {k: statistics.median(max(rr[k] for rr in res) for res, _ in runs) for k in
                       ("save_s", "build_s", "load_s")}  # fmt: skip
                params = sum(rr["local_params"] for rr in runs[0][0])  # TP/PP shards (no DP here) sum to the model
                exact = all(rr["exact"] for res, _ in runs for rr in res)
                rows.append((name, f"TP{tp}xPP{pp}", params, runs[0][1], med, exact))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"{'model':6} {'layout':8} {'params':>10} {'size MiB':>9} {'save s':>7} {'load s':>7} {'build+weights s':>15} {'MiB/s save':>10} exact"
    )
    for name, layout, params, size, med, exact in rows:
        print(f"{name:6} {layout:8} {params / 1e6:9.2f}M {size / 2**20:9.1f} {med['save_s']:7.2f} {med['load_s']:7.2f} "
              f"{med['build_s']:15.2f} {size / 2**20 / med['save_s']:10.1f} {exact}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
