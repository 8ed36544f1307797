"""Module-level functions the rank-pool tests send to ranks (they must be importable)."""

import torch


def allreduce_rank(x):
    t = torch.tensor([float(x + torch.distributed.get_rank())])
    torch.distributed.all_reduce(t)
    return t.item()


def megatron_imported():
    import sys

    return "megatron.core" in sys.modules


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


def _child_waits_for_its_parent(parent):
    import os
    import time

    while os.getppid() == parent:  # ends once the rank is killed: nothing outlives the test
        time.sleep(0.05)


def hang_in_a_forked_child(bad_rank):
    """bad_rank waits forever on a forked child (as a save waits on a stuck writer); the others in a barrier."""
    import multiprocessing
    import os

    if torch.distributed.get_rank() == bad_rank:
        child = multiprocessing.get_context("fork").Process(target=_child_waits_for_its_parent, args=(os.getpid(),))
        child.start()
        child.join()
    torch.distributed.barrier()
    return True


def switch_layouts(layouts):
    """Switch megatron's parallel layout repeatedly; return this rank's thread count after each switch."""
    import gc
    import threading

    from mindrl.launch import init_model_parallel

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


def _threads() -> list[tuple[str, int]]:
    """(name, voluntary context switches) of each thread of this process."""
    import os

    out = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        out.append((fields["Name"], int(fields["voluntary_ctxt_switches"])))
    return out


def gloo_loops_and_wakeups(tp, window_s):
    """After megatron's groups for TP `tp` exist (and a collective ran on one of them): this rank's gloo event-loop
    threads, its gloo process groups, and its threads' wake-ups per second while idle for `window_s`."""
    import time

    from megatron.core import parallel_state as ps

    from mindrl.launch import init_model_parallel

    init_model_parallel(tp, 1)
    t = torch.tensor([1.0])
    torch.distributed.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    assert t.item() == tp
    before = sum(n for _, n in _threads())
    time.sleep(window_s)
    after = _threads()
    rate = (sum(n for _, n in after) - before) / window_s
    groups = len(torch.distributed.distributed_c10d._world.pg_map)
    return [name for name, _ in after].count("gloo_tcp_loop"), groups, rate


def gloo_group_with_own_options():
    """A one-rank gloo group built through torch's options constructor (its own device): it works, and adds a loop."""
    from torch.distributed import PrefixStore
    from torch.distributed import distributed_c10d as c10d

    loops = [name for name, _ in _threads()].count("gloo_tcp_loop")
    options = c10d.ProcessGroupGloo._Options()
    options._devices = [c10d.ProcessGroupGloo.create_default_device()]
    store = PrefixStore(f"own_options_{torch.distributed.get_rank()}", c10d._get_default_store())
    pg = c10d.ProcessGroupGloo(store, 0, 1, options)
    t = torch.tensor([2.0])
    pg.allreduce([t]).wait()
    return t.item(), [name for name, _ in _threads()].count("gloo_tcp_loop") - loops
