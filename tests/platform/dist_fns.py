"""Module-level functions the rank-pool tests send to ranks (they must be importable)."""

import torch


def allreduce_rank(x):
    t = torch.tensor([float(x + torch.distributed.get_rank())])
    torch.distributed.all_reduce(t)
    return t.item()


def fail_on_rank(bad_rank):
    if torch.distributed.get_rank() == bad_rank:
        raise ValueError(f"boom on {bad_rank}")
    torch.distributed.barrier()  # the healthy ranks block here: the pool must still return
    return True


def exit_on_rank(bad_rank, code):
    import os

    if torch.distributed.get_rank() == bad_rank:
        os._exit(code)
    torch.distributed.barrier()
    return True


def switch_layouts(layouts):
    """Switch megatron's parallel layout repeatedly; return this rank's thread count after each switch."""
    import gc
    import threading

    from mindrl.platform.launch import init_model_parallel

    counts = []
    for tp, pp in layouts:
        init_model_parallel(tp, pp)
        t = torch.tensor([1.0])
        from megatron.core import parallel_state as ps

        torch.distributed.all_reduce(t, group=ps.get_tensor_model_parallel_group())
        assert t.item() == tp
        gc.collect()  # groups that earlier tests on this shared rank left in garbage cycles go now, not mid-count
        counts.append(threading.active_count() + _native_threads())
    return counts


def _native_threads():
    import os

    return len(os.listdir("/proc/self/task"))


def report_pid_then_block(path):
    """Write this rank's pid, then block: rank 0 in a barrier that rank 1 never joins."""
    import os
    import time

    with open(f"{path}.{torch.distributed.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    if torch.distributed.get_rank() == 0:
        torch.distributed.barrier()
    time.sleep(3600)
