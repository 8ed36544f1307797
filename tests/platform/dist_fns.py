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


def gloo_loops_and_wakeups(tp, window_s):
    """After megatron's groups for TP `tp` exist (and a collective ran on one of them): this rank's gloo event-loop
    threads, its gloo process groups, and its threads' wake-ups per second while idle for `window_s`."""
    import os
    import time

    from megatron.core import parallel_state as ps

    from mindrl.platform.launch import init_model_parallel

    init_model_parallel(tp, 1)
    t = torch.tensor([1.0])
    torch.distributed.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    assert t.item() == tp

    def switches():
        total = 0
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        return total

    def names():
        out = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                out.append(f.read().strip())
        return out

    before = switches()
    time.sleep(window_s)
    rate = (switches() - before) / window_s
    groups = len(torch.distributed.distributed_c10d._world.pg_map)
    return names().count("gloo_tcp_loop"), groups, rate
