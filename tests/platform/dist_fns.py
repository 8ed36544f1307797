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
