"""The actor's and the critic's megatron computations on an RL batch (`mindrl.batch`): response logprobs, values and PPO
updates through megatron's pipeline schedule, collective over the model's world (losses: `mindrl.algorithms`)."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core import parallel_state as ps
from megatron.core.utils import get_model_config

from mindrl.algorithms import (
    agg_loss,
    count_tokens_and_seqs,
    gspo_policy_loss,
    kl_loss,
    masked_mean,
    policy_loss,
    value_loss,
)
from mindrl.algorithms.staleness import truncated_importance_ratio
from mindrl.batch import Batch
from mindrl.models.attention import PrefixGroups
from mindrl.models.context_parallel import CPSplit, cp_size
from mindrl.models.forward import attention_inputs, model_device, moe_padding, prefix_group_inputs, run_schedule
from mindrl.models.moe import ExpertLoad, expert_load_metrics, take_load_balancing_loss
from mindrl.models.packing import PackedRows, cut_by_budget, pack_rows
from mindrl.models.vocab_parallel import vocab_parallel_logprobs
from mindrl.platform import current_platform, env_switch
from mindrl.workers.profiling import OPTIMIZER_RANGE
from mindrl.workers.results import LogprobDiff, TokenCounts, UpdateResult
from mindrl.workers.settings import MicroBatching, PPOLossSettings

SAVINGS = True
"""Padding trim per micro-batch, output layer on the response positions only, entropy without a graph when its
coefficient is 0, rows that share a prompt packed with it once (`PREFIX_SHARING`). False: the plain path (every
micro-batch at the batch's widths), kept for equality tests."""

PREFIX_SHARING = True
"""With SAVINGS: consecutive rows with the same prompt go through the model as prefix groups. False: each row on its
own (A/B and equality tests). The environment's MINDRL_PREFIX_SHARING=0 turns it off too (`prefix_sharing`)."""

PREFIX_SHARING_ENV = "MINDRL_PREFIX_SHARING"

_SAMPLES = "prefix_samples"
"""A micro-batch's meta key: rows per prefix group (absent: rows on their own)."""

ROUTED_EXPERTS = "routed_experts"
"""A batch key (routing replay, rl_config.router_replay_mode R2): [rows, P + R, MoE layers, top-k] int16, the
experts each token's router chose in the old-logprob pass (vLLM's `routed_experts` per request: [tokens, layers,
k]). An actor update given it routes every token by it (megatron's router replay)."""

_PACKED = "packed_rows"
"""A micro-batch's meta key: its rows packed into one (`PackedRows`; absent: the rows padded to its widths)."""


def _batching(micro: int | MicroBatching) -> MicroBatching:
    return micro if isinstance(micro, MicroBatching) else MicroBatching(rows=int(micro))


def _layout(mb: Batch) -> PrefixGroups | None:
    """The packed layout of a micro-batch of prefix groups (see `_plan`); None for rows on their own."""
    n = mb.meta.get(_SAMPLES, 1)
    return PrefixGroups(mb.meta["prompt_length"], n, mb["responses"].shape[1]) if n > 1 else None


def _packed(mb: Batch) -> PackedRows | None:
    """The micro-batch's rows packed into one (see `_plan`); None for padded rows."""
    return mb.meta.get(_PACKED)


def _response_slice(output: torch.Tensor, mb: Batch, head_sliced: bool) -> torch.Tensor:
    """The outputs that predict the response tokens, (rows, R, ...); head_sliced: the output layer only ran on those
    already. Response token t of a row sits at column P + t of input_ids (P = the batch's prompt width) and is
    predicted by the output at column P + t - 1, so the responses' outputs are columns [P - 1, P - 1 + R)."""
    if head_sliced:
        return output
    packed = _packed(mb)
    if packed is not None:  # [1, s, ...] -> [rows, R, ...]
        return output.index_select(1, packed.sources).reshape(len(mb), packed.response, *output.shape[2:])
    layout = _layout(mb)
    if layout is not None:  # [G, s, ...] -> [G * n, R, ...]
        picked = output.index_select(1, layout.response_sources(output.device))
        return picked.reshape(len(mb), layout.response, *output.shape[2:])
    p, r = mb.meta["prompt_length"], mb["responses"].shape[1]
    return output[:, p - 1 : p - 1 + r]


def _model_inputs(mb: Batch):
    packed = _packed(mb)
    if packed is not None:
        return packed.ids, packed.positions.view(1, -1), packed.mask()
    layout = _layout(mb)
    if layout is not None:
        n, p, ids, mask = layout.samples, layout.prompt, mb["input_ids"], mb["attention_mask"]
        ids, position_ids, mask, _ = prefix_group_inputs(ids[::n, :p], mask[::n, :p], ids[:, p:], mask[:, p:])
        return ids, position_ids, mask
    ids = mb["input_ids"]
    position_ids, mask = attention_inputs(ids, mb["attention_mask"])
    return ids, position_ids, mask


def _padding_mask(mb: Batch) -> torch.Tensor:
    """[rows as the model sees them, width] True on the padding columns of `_model_inputs`' ids (for the MoE
    router, `moe_padding`)."""
    packed = _packed(mb)
    if packed is not None:
        return torch.arange(packed.width, device=packed.ids.device).view(1, -1) >= packed.real
    valid = mb["attention_mask"].bool()
    layout = _layout(mb)
    if layout is not None:
        n, p = layout.samples, layout.prompt
        groups = valid.shape[0] // n
        valid = torch.cat([valid[::n, :p], valid[:, p:].reshape(groups, n * (valid.shape[1] - p))], 1)
    return ~valid


def _model_cells(mb: Batch) -> tuple[torch.Tensor, int, int]:
    """Where each cell of mb's rows goes through the model: ([rows, width] the flat index into the model's input
    [b, s] (row-major), -1 for a padding cell that has no column there (packed rows); b; s)."""
    rows, width = mb["input_ids"].shape
    device = mb["input_ids"].device
    packed = _packed(mb)
    if packed is not None:
        cells = torch.full((rows, width), -1, dtype=torch.long, device=device)
        cells[mb["attention_mask"].bool()] = torch.arange(packed.real, device=device)
        return cells, 1, packed.width
    layout = _layout(mb)
    if layout is not None:  # a group's rows share its prompt columns; sample j's response follows at p + j * r
        n, p = layout.samples, layout.prompt
        r, s = width - p, p + n * (width - p)
        row = torch.arange(rows, device=device).view(-1, 1)
        col = torch.arange(width, device=device).view(1, -1)
        return (row // n) * s + torch.where(col < p, col, p + (row % n) * r + col - p), rows // n, s
    return torch.arange(rows * width, device=device).view(rows, width), rows, width


def _own_tokens(s: int, sp: bool) -> tuple[int, int]:
    """The model columns [start, end) this rank's routers see: its sequence-parallel slice (sp), or all of them."""
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not sp:
        return 0, s
    rank = ps.get_tensor_model_parallel_rank()
    return rank * s // tp, (rank + 1) * s // tp


def _unrouted(shape: tuple[int, ...], k: int, device) -> torch.Tensor:
    """Choices for cells no router saw (padding): experts 0 .. k - 1, distinct as a top-k's are."""
    return torch.arange(k, device=device).expand(*shape, k).clone()


def _replay_targets(replay, mb: Batch) -> None:
    """mb's ROUTED_EXPERTS [rows, width, layers, k] as the routers' next targets, in their token order."""
    routed = mb[ROUTED_EXPERTS].long()
    layers, k = routed.shape[2:]
    routed[~mb["attention_mask"].bool()] = torch.arange(k, device=routed.device)  # padding: any k distinct
    cells, b, s = _model_cells(mb)
    flat = _unrouted((b * s, layers), k, routed.device)
    valid = cells >= 0
    flat[cells[valid]] = routed[valid]
    start, end = _own_tokens(s, replay.routers[0].config.sequence_parallel)
    replay.set_targets(flat.view(b, s, layers, k).transpose(0, 1)[start:end].reshape(-1, layers, k))


def _recorded_choices(replay, mb: Batch) -> torch.Tensor:
    """[rows, width, layers, k] the choices the routers made for mb's cells in the forward just run."""
    cells, b, s = _model_cells(mb)
    got = replay.recorded()  # [this rank's tokens, layers, k], sequence-major
    if replay.routers[0].config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
        parts = [torch.empty_like(got) for _ in range(ps.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(parts, got.contiguous(), group=ps.get_tensor_model_parallel_group())
        got = torch.cat(parts)
    layers, k = got.shape[1:]
    flat = got.view(s, b, layers, k).transpose(0, 1).reshape(b * s, layers, k)
    out = _unrouted((*cells.shape, layers), k, got.device)
    valid = cells >= 0
    out[valid] = flat[cells[valid]]
    return out


def _inner(model, name: str) -> torch.nn.Module | None:
    """The model's submodule `name` through its wrappers (DDP, Float16Module); None where it has none."""
    while not hasattr(model, name):
        if not hasattr(model, "module"):
            return None
        model = model.module
    return getattr(model, name)


def _output_layer(model) -> torch.nn.Module | None:
    """The model's output layer through its wrappers; None off the last pipeline stage."""
    return _inner(model, "output_layer")


@contextmanager
def _packed_positions(model, mb: Batch):
    """For prefix groups and packed rows, RoPE at each packed column's own-row position (`PrefixGroups.positions`,
    `PackedRows.positions`): megatron builds the rotary table for columns 0 .. s - 1, and a hook on its rotary module
    picks the table's rows."""
    layout, packed, rotary = _layout(mb), _packed(mb), _inner(model, "rotary_pos_emb")
    if layout is None and packed is None:
        yield
        return
    if rotary is None:
        raise RuntimeError("prefix groups and packed rows need the model's rotary embedding (RoPE)")
    positions = packed.positions if packed is not None else layout.positions(model_device(model))
    width = len(positions)
    split = _cp_split(mb)
    if split is not None:  # megatron's table holds this rank's chunks of columns: pick from the whole one instead
        positions = split.local(positions, 0)

    def pick(module, args, output):
        if split is not None:
            return module.get_emb(width).index_select(0, positions)
        if output.shape[0] != width:
            raise RuntimeError(f"rotary table of {output.shape[0]} rows for packed rows of {width} columns")
        return output.index_select(0, positions)

    handle = rotary.register_forward_hook(pick)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _response_head(model, mb: Batch):
    """Apply the output layer (LM head or value head) to the response positions only: a pre-hook cuts the
    decoder's hidden states [s, b, h] to rows [P - 1, P - 1 + R) before it. Yields whether it did: not off the
    last pipeline stage (no output layer) nor under sequence or context parallelism (each rank holds part of the
    rows there; the outputs are sliced afterwards instead)."""
    head = _output_layer(model)
    if not SAVINGS or head is None or get_model_config(model).sequence_parallel or cp_size() > 1:
        yield False
        return
    start, length = mb.meta["prompt_length"] - 1, mb["responses"].shape[1]
    layout, packed = _layout(mb), _packed(mb)
    sources = None if layout is None else layout.response_sources(model_device(model))

    # The head runs on the rows in batch-major order, [b, R, h], and hands megatron the [R, b, V] transposed view
    # of its output, so megatron's closing transpose(0, 1).contiguous() to [b, R, V] is a view, not a copy of the
    # logits (one copy of R x b x V in forward and one in backward); the hidden states moved instead are V / h times
    # smaller.
    def cut(module, args, kwargs):
        hidden = args[0]
        if packed is not None:  # [s, 1, h] -> [rows, R, h]
            picked = hidden.index_select(0, packed.sources).view(len(mb), length, hidden.shape[2])
            return (picked, *args[1:]), kwargs
        if sources is None:
            return (hidden[start : start + length].transpose(0, 1).contiguous(), *args[1:]), kwargs
        # prefix groups: [g * R, G, h] picked columns -> [G * g, R, h], rows in (prompt, sample) order
        picked = hidden.index_select(0, sources).view(layout.samples, length, hidden.shape[1], hidden.shape[2])
        return (picked.permute(2, 0, 1, 3).reshape(-1, length, hidden.shape[2]), *args[1:]), kwargs

    def seq_major(module, args, output):
        out, bias = output
        return out.transpose(0, 1), bias

    handles = [
        head.register_forward_pre_hook(cut, with_kwargs=True),
        head.register_forward_hook(seq_major),
    ]
    try:
        yield True
    finally:
        for handle in handles:
            handle.remove()


def _cp_split(mb: Batch) -> CPSplit | None:
    """How the micro-batch's columns split over the context-parallel group (None without CP)."""
    n = cp_size()
    return CPSplit(_model_shape(mb)[0], n, ps.get_context_parallel_rank()) if n > 1 else None


def _forward(model, mb: Batch) -> tuple[torch.Tensor, bool]:
    """(the model's outputs for micro-batch mb, whether they cover the response positions only). Under context
    parallelism the model runs on this rank's columns (`CPSplit`) and the outputs are those columns'."""
    ids, position_ids, mask = _model_inputs(mb)
    padding = _padding_mask(mb) if get_model_config(model).num_moe_experts else None
    split = _cp_split(mb)
    if split is not None:
        ids, position_ids, mask = split.local(ids, 1), split.local(position_ids, -1), split.local_mask(mask)
        padding = None if padding is None else split.local(padding, 1)
    moe = {} if padding is None else moe_padding(model, padding)
    with _response_head(model, mb) as sliced, _packed_positions(model, mb):
        return model(ids, position_ids, mask, **moe), sliced


def _column_labels(mb: Batch) -> torch.Tensor:
    """[rows as the model sees them, width] the response token each model column predicts (0 where none)."""
    responses = mb["responses"]
    packed = _packed(mb)
    if packed is not None:  # the real response tokens' predicting columns (padding ones point at column 0)
        valid = mb["attention_mask"][:, mb["input_ids"].shape[1] - responses.shape[1] :].bool()
        labels = responses.new_zeros(1, packed.width)
        labels[0, packed.sources.view(valid.shape)[valid]] = responses[valid]
        return labels
    if _layout(mb) is not None:
        raise RuntimeError("prefix groups do not run under context parallelism")
    p, r = mb.meta["prompt_length"], responses.shape[1]
    labels = responses.new_zeros(mb["input_ids"].shape)
    labels[:, p - 1 : p - 1 + r] = responses
    return labels


def _token_logprobs(output, mb: Batch, sliced: bool, temperature: float, **kw):
    """(rows, R) logprobs of the response tokens and their entropy (`vocab_parallel_logprobs`; kw: with_entropy,
    entropy_grad). Under context parallelism each rank computes its columns' and they are gathered to full rows."""
    split = _cp_split(mb)
    if split is None:
        return vocab_parallel_logprobs(_response_slice(output, mb, sliced), mb["responses"], temperature, **kw)
    labels = split.local(_column_labels(mb), 1)
    lp, ent = vocab_parallel_logprobs(output, labels, temperature, **kw)

    def rows(t):
        return None if t is None else _response_slice(split.full(t, 1).unsqueeze(-1), mb, False).squeeze(-1)

    return rows(lp), rows(ent)


def _token_values(output, mb: Batch, sliced: bool) -> torch.Tensor:
    """(rows, R) fp32 values before each response token (gathered over context parallelism)."""
    split = _cp_split(mb)
    if split is not None:
        output = split.full(output, 1)
    return _response_slice(output, mb, sliced).squeeze(-1).float()


def _model_shape(mb: Batch) -> tuple[int, int]:
    """(sequence width, rows) of the micro-batch as the model sees it (prefix groups, packed rows: packed)."""
    packed = _packed(mb)
    if packed is not None:
        return packed.width, 1
    layout = _layout(mb)
    if layout is None:
        return mb["input_ids"].shape[1], len(mb)
    return layout.width, len(mb) // layout.samples


def _schedule(model, micro: list[Batch], step_fn, forward_only: bool, collect: bool = False):
    # The shape sizes the pipeline's P2P buffers. Row-count micro-batches of padded rows all have the same under
    # PP (_plan); packed rows and token-budget micro-batches do not, and the stages send each other their shapes
    # first (megatron's variable_seq_lengths).
    shapes = {_model_shape(mb) for mb in micro}
    width, rows = max(shapes)
    config = get_model_config(model)
    variable = config.variable_seq_lengths
    config.variable_seq_lengths = variable or (len(shapes) > 1 and ps.get_pipeline_model_parallel_world_size() > 1)
    try:
        return run_schedule(model, step_fn, micro, width, rows, forward_only, collect)
    finally:
        config.variable_seq_lengths = variable


@dataclass
class _Plan:
    """A batch cut into micro-batches of rows of similar length, each trimmed to its own widths."""

    micro: list[Batch]
    order: torch.Tensor
    """Row of the batch behind each row of the concatenated micro-batches."""
    response_width: int
    """The batch's R, to which per-row outputs are padded back."""
    computed_tokens: int
    """Positions the model runs on: sum over micro-batches of rows x width (prefix groups: one packed row each,
    so fewer than real_tokens where rows share prompts)."""
    real_tokens: int
    untrimmed_tokens: int
    """rows x (P + R): what the batch's own rectangle would have cost."""
    shared_tokens: int = 0
    """Real prompt tokens not computed again: a prefix group of n rows computes its prompt once, not n times."""

    def restore(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """Per-micro-batch (rows, width) outputs -> (batch rows, R) in the batch's row order, zero-padded."""
        r = self.response_width
        flat = torch.cat([torch.nn.functional.pad(o, (0, r - o.shape[1])) for o in outputs]).cpu()
        out = torch.empty_like(flat)
        out[self.order] = flat
        return out


def prefix_sharing() -> bool:
    """Whether rows that share a prompt run as prefix groups: PREFIX_SHARING, and MINDRL_PREFIX_SHARING (1, the
    default, or 0; read at every plan, so that a worker's environment decides, e.g. through the runtime env)."""
    return env_switch(PREFIX_SHARING_ENV) and PREFIX_SHARING  # the variable is checked either way


def prompt_group_size(batch: Batch, micro_batch_size: int) -> int:
    """The prefix groups of the batch's rows: the largest n dividing both its group size (`Batch.group_size`: runs of
    consecutive rows with the same prompt) and micro_batch_size. Raises if the rows contradict the group size (a
    row whose prompt ids or mask differ from its group's first row's)."""
    g = batch.group_size
    if g > 1:
        p = batch.meta["prompt_length"]
        mask = batch["attention_mask"][:, :p].bool()
        ids = batch["input_ids"][:, :p].masked_fill(~mask, 0).reshape(-1, g, p)
        mask = mask.reshape(-1, g, p)
        if not ((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all()):
            raise ValueError(f"the batch says its rows come in groups of {g} with the same prompt, but they do not")
    return math.gcd(g, micro_batch_size)


def _plan(model, batch: Batch, micro: int | MicroBatching) -> _Plan:
    """Micro-batches without padding waste: rows sorted by real length (longest first), cut into micro-batches of
    `MicroBatching.rows` rows or by its token budget, each micro-batch cut to its longest real prompt and response, or
    packed into one row without padding (`MicroBatching.packed`). Under pipeline parallelism the schedule's P2P
    buffers of padded row-count micro-batches take one shape, so every micro-batch gets the widths of the whole batch
    (rows kept in order); under sequence parallelism the width (packed: the packed width) is rounded up to a
    multiple of TP. Rows that share a prompt (`Batch.group_size`, `prompt_group_size`) stay together and go through
    the model as prefix groups (`PREFIX_SHARING`; not under context parallelism, nor with packing or a token budget).
    The micro-batches are on the model's device."""
    spec = _batching(micro)
    n = len(batch)
    device = model_device(model)
    mbs = min(spec.rows, n)
    if spec.token_budget is None and n % mbs:
        raise ValueError(f"{n} rows do not split into micro-batches of {mbs}")
    p_len, r_len = batch.real_widths()
    multiple = ps.get_tensor_model_parallel_world_size() if get_model_config(model).sequence_parallel else 1
    multiple *= 2 * cp_size() if cp_size() > 1 else 1  # context parallelism: 2 x CP chunks per row
    if not SAVINGS and cp_size() > 1:
        raise ValueError("the plain path (rl_model.SAVINGS off) does not pad rows for context parallelism")
    if not SAVINGS:
        micro = [mb.to(device) for mb in batch.split(n // mbs)]
        tokens = n * batch["input_ids"].shape[1]
        return _Plan(micro, torch.arange(n), batch["responses"].shape[1], tokens, real_tokens(batch), tokens)
    own_rows = spec.packed or spec.token_budget is not None
    uniform = ps.get_pipeline_model_parallel_world_size() > 1 and not own_rows
    shareable = (
        not own_rows
        and prefix_sharing()
        and ps.get_context_parallel_world_size() == 1
        and _inner(model, "rotary_pos_emb") is not None
    )
    group = prompt_group_size(batch, mbs) if shareable else 1
    if uniform:
        groups = torch.arange(n // group)
    else:  # longest group first; stable: ties keep the batch's order
        groups = torch.sort((p_len + r_len).view(-1, group).amax(1), descending=True, stable=True).indices
    order = (groups.view(-1, 1) * group + torch.arange(group)).flatten()
    if spec.token_budget is None:
        cuts = [order[k : k + mbs] for k in range(0, n, mbs)]
    else:
        cuts = [torch.tensor(rows) for rows in _cut_by_tokens(order, p_len, r_len, spec)]
        order = torch.cat(cuts)
    micro, computed = [], 0
    for rows in cuts:
        span = order if uniform else rows
        pw, rw = max(1, int(p_len[span].max())), max(1, int(r_len[span].max()))
        if not spec.packed:
            pw += -(pw + group * rw) % multiple
        mb = batch.index(rows).reframe(pw, rw)
        if group > 1:
            mb.meta[_SAMPLES] = group
        mb = mb.to(device)
        if spec.packed:
            mb.meta[_PACKED] = pack_rows(mb["input_ids"], mb["attention_mask"], pw, multiple)
            computed += mb.meta[_PACKED].width
        else:
            computed += len(rows) // group * (pw + group * rw)
        micro.append(mb)
    untrimmed = n * batch["input_ids"].shape[1]
    shared = int(p_len.view(-1, group)[:, 1:].sum())
    return _Plan(micro, order, batch["responses"].shape[1], computed, real_tokens(batch), untrimmed, shared)


def _cut_by_tokens(order: torch.Tensor, p_len: torch.Tensor, r_len: torch.Tensor, spec: MicroBatching):
    """The rows in `order` cut by the token budget (`cut_by_budget`): a micro-batch costs its real tokens packed,
    rows x (longest prompt + longest response) padded."""
    prompts, responses = p_len.tolist(), r_len.tolist()
    if spec.packed:

        def cost(rows: list[int]) -> int:
            return sum(prompts[r] + responses[r] for r in rows)
    else:

        def cost(rows: list[int]) -> int:
            return len(rows) * (max(prompts[r] for r in rows) + max(responses[r] for r in rows))

    return cut_by_budget(order.tolist(), cost, spec.token_budget, spec.max_rows)


def real_tokens(batch: Batch) -> int:
    return int(batch["attention_mask"].sum())


# ---------------------------------------------------------------------------------------------- forward only


@torch.no_grad()
def response_logprobs(
    model, batch: Batch, micro_batch_size: int | MicroBatching, temperature: float, record_routing: bool = False
) -> torch.Tensor | None | tuple[torch.Tensor | None, torch.Tensor]:
    """(rows, R) logprob of each response token under softmax(logits / temperature); None off the last stage.
    record_routing (a MoE model): also the experts each token's routers chose, as the batch's ROUTED_EXPERTS
    [rows, P + R, MoE layers, k] (returned as a pair)."""
    recorded: list[tuple[torch.Tensor, int]] = []
    replay = _replay_for(model, "record") if record_routing else None

    def step(data_iterator, model):
        mb = next(data_iterator)
        output, sliced = _forward(model, mb)
        if replay is not None:
            recorded.append((_recorded_choices(replay, mb).cpu(), mb.meta["prompt_length"]))

        def collect(output_tensor, non_loss_data=True):
            lp, _ = _token_logprobs(output_tensor, mb, sliced, temperature)
            return lp * mb["response_mask"]

        return output, collect

    if replay is None:
        return _forward_only(model, batch, micro_batch_size, step)
    plans: list[_Plan] = []
    with replay:
        lp = _forward_only(model, batch, micro_batch_size, step, plans)
    return lp, _routing_table(batch, plans[0], recorded)


def _replay_for(model, mode: str):
    """`RoutingReplay` on the model's routers, where mindrl can lay the tokens out for them (not across pipeline
    stages or context-parallel chunks, nor with activation recompute, which would route again in the backward)."""
    from mindrl.models.moe import RoutingReplay

    config = get_model_config(model)
    if not config.num_moe_experts:
        raise ValueError("routing replay needs a mixture-of-experts model; this one has no routers")
    if ps.get_pipeline_model_parallel_world_size() > 1 or cp_size() > 1:
        raise ValueError("routing replay (rl_config.router_replay_mode) is not built for pipeline or context "
                         "parallelism (actor_config.pipeline_model_parallel_size / context_parallel_size > 1)")  # fmt: skip
    if config.recompute_granularity is not None:
        raise ValueError("routing replay (rl_config.router_replay_mode) with activation recompute is not built")
    return RoutingReplay(model, mode)


def _routing_table(batch: Batch, plan: _Plan, recorded: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The micro-batches' recorded choices ([rows, P' + R', layers, k], P') put back at the batch's rows and
    columns: [rows, P + R, layers, k] int16 (a micro-batch's column j is the batch's P - P' + j)."""
    p, width = batch.meta["prompt_length"], batch["input_ids"].shape[1]
    layers, k = recorded[0][0].shape[2:]
    table = _unrouted((len(batch), width, layers), k, "cpu")
    start = 0
    for got, mb_p in recorded:
        rows = plan.order[start : start + got.shape[0]]
        start += got.shape[0]
        cols = torch.arange(got.shape[1]) + p - mb_p
        keep = (cols >= 0) & (cols < width)
        table[rows.view(-1, 1), cols[keep].view(1, -1)] = got[:, keep]
    return table.to(torch.int16)


@torch.no_grad()
def response_values(model, batch: Batch, micro_batch_size: int | MicroBatching) -> torch.Tensor | None:
    """(rows, R) the critic's value of the state before each response token; None off the last stage."""

    def step(data_iterator, model):
        mb = next(data_iterator)
        output, sliced = _forward(model, mb)

        def collect(output_tensor, non_loss_data=True):
            return _token_values(output_tensor, mb, sliced) * mb["response_mask"]

        return output, collect

    return _forward_only(model, batch, micro_batch_size, step)


def _forward_only(
    model, batch: Batch, micro_batch_size: int | MicroBatching, step, plans: list | None = None
) -> torch.Tensor | None:
    plan = _plan(model, batch, micro_batch_size)
    if plans is not None:
        plans.append(plan)
    was_training = model.training
    model.eval()
    try:
        outputs = _schedule(model, plan.micro, step, forward_only=True, collect=True)
    finally:
        model.train(was_training)
    return plan.restore(outputs) if ps.is_pipeline_last_stage() else None


# ---------------------------------------------------------------------------------------------- updates


def _global_counts(batch: Batch) -> tuple[float, float]:
    """(valid tokens, valid sequences) of the whole mini-batch over all data-parallel ranks."""
    # Collectives take tensors on the rank's device (nccl and hccl have no host tensors).
    t = torch.tensor(
        count_tokens_and_seqs(batch["response_mask"]), dtype=torch.float64, device=current_platform().device()
    )
    torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t[0]), float(t[1])


def _actor_loss(mb: Batch, s: PPOLossSettings, agg: dict, num_micro: int, sliced: bool, output: torch.Tensor):
    mask = mb["response_mask"]
    # With entropy_coeff 0 the entropy is only a metric: no graph over the vocabulary is built for it.
    log_prob, entropy = _token_logprobs(
        output, mb, sliced, s.temperature, with_entropy=True, entropy_grad=s.entropy_coeff != 0 or not SAVINGS
    )
    # Exactly on-policy (no old-logprob recompute): the old policy is the current one, the ratio is 1.
    old = mb["old_log_prob"] if "old_log_prob" in mb else log_prob.detach()
    is_weights = is_metrics = None
    if s.rollout_is_threshold is not None:
        # against the behaviour logprobs: the engine's numerics, and with async_mode its older weights
        is_weights, is_metrics = truncated_importance_ratio(old, mb["rollout_log_prob"], mask, s.rollout_is_threshold)
    if s.policy_loss_mode == "gspo":
        pg_loss, m = gspo_policy_loss(
            old, log_prob, mb["advantages"], mask, s.clip_ratio_low, s.clip_ratio_high, is_weights=is_weights, **agg
        )
    else:
        pg_loss, m = policy_loss(
            old,
            log_prob,
            mb["advantages"],
            mask,
            s.clip_ratio_low,
            s.clip_ratio_high,
            s.clip_ratio_c,
            s.loss_agg_mode,
            is_weights=is_weights,
            **agg,
        )
    ent = agg_loss(entropy, mask, s.loss_agg_mode, **agg)
    loss = pg_loss - s.entropy_coeff * ent
    kl = torch.zeros((), device=log_prob.device)
    if s.kl_loss_coef > 0:
        kl = kl_loss(log_prob, mb["ref_log_prob"], mask, s.kl_loss_type, s.loss_agg_mode, **agg)
        loss = loss + s.kl_loss_coef * kl
    # Token-weighted shares of the mini-batch (they sum to the mini-batch value over micro-batches and DP).
    share = mask.sum() / agg["global_num_tokens"]
    signed = (log_prob.detach() - mb["rollout_log_prob"]) * mask
    diff = signed.abs()
    seq_diff = signed.sum(-1).abs()  # |log pi(y) - log mu(y)| of each whole response: its sequence-level ratio
    dp = agg["dp_size"]
    metrics = {
        "actor/pg_loss": pg_loss.detach() / dp,
        "actor/entropy": ent.detach() / dp,
        "actor/kl_loss": kl.detach() / dp,
        "actor/pg_clipfrac": m["pg_clipfrac"] * share,
        "actor/pg_clipfrac_lower": m["pg_clipfrac_lower"] * share,
        "actor/ppo_kl": m["ppo_kl"] * share,
        "_diff_sum": diff.sum(),
        "_diff_max": diff.max() if diff.numel() else torch.zeros((), device=diff.device),
        "_seq_diff_sum": seq_diff.sum(),
        "_seq_diff_max": seq_diff.max() if seq_diff.numel() else torch.zeros((), device=diff.device),
    }
    if is_weights is not None:
        metrics["actor/is_weight_mean"] = masked_mean(is_weights, mask) * share
        metrics["actor/is_truncated_frac"] = is_metrics["is_truncated_frac"] * share
    # The schedule divides by the number of micro-batches and DDP averages over DP: undo both, so the
    # gradient is that of the mini-batch loss normalised by its global token (or sequence) count.
    return loss * num_micro, {k: v.detach().clone() for k, v in metrics.items()}


def _critic_loss(mb: Batch, s: PPOLossSettings, agg: dict, num_micro: int, sliced: bool, output: torch.Tensor):
    mask = mb["response_mask"]
    vpreds = _token_values(output, mb, sliced)
    loss, m = value_loss(vpreds, mb["returns"], mb["values"], mask, s.cliprange_value, s.loss_agg_mode, **agg)
    share = mask.sum() / agg["global_num_tokens"]
    metrics = {"critic/vf_loss": loss.detach() / agg["dp_size"], "critic/vf_clipfrac": m["vf_clipfrac"] * share}
    return loss * num_micro, {k: v.detach().clone() for k, v in metrics.items()}


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of `t` is finite. The sum (accumulated in fp32 at least) is NaN or +-inf whenever an
    element is, and costs one read of the tensor instead of isfinite's temporaries (docs/performance.md); only a
    sum that overflows from finite elements takes the exact element-wise check."""
    if t.numel() == 0:
        return True
    total = t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()
    return bool(torch.isfinite(total)) or bool(torch.isfinite(t).all())


def _grads_finite(model) -> bool:
    """All ranks agree whether every gradient is finite (a NaN anywhere skips the step everywhere)."""
    bad = torch.zeros(1, device=current_platform().device())
    checked = set()  # grad buffers' storages: their parameters' main_grad are views of them
    for buf in list(getattr(model, "buffers", [])) + list(getattr(model, "expert_parallel_buffers", [])):
        checked.add(buf.grad_data.untyped_storage().data_ptr())
        if not all_finite(buf.grad_data):
            bad[0] = 1
    for p in model.parameters():
        g = getattr(p, "main_grad", None)
        if g is not None and g.untyped_storage().data_ptr() not in checked and not all_finite(g):
            bad[0] = 1
    torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    return bad.item() == 0


def ppo_update(
    ddp,
    optimizer,
    scheduler,
    shard: Batch,
    role: str,
    settings: PPOLossSettings,
    micro_batch_size: int | MicroBatching,
    num_mini_batches: int,
    epochs: int,
    step_context=None,
) -> UpdateResult:
    """Epochs x mini-batches of optimizer steps on this DP rank's shard (see `mindrl.batch.shard_rows`: its
    mini-batch k is its slice of the global mini-batch k). role: "actor" or "critic". micro_batch_size: rows per
    micro-batch, or how to cut and lay them out (`MicroBatching`); the loss is the mini-batch's whatever the cut.
    step_context: a context manager factory entered around each optimizer step (swap_optimizer brings the optimizer
    state to the device in it); None: none.

    Returns metrics averaged over the optimizer steps (the same on every rank), plus `<role>/lr`,
    `<role>/grad_norm`, `<role>/skipped_updates` (steps skipped for non-finite loss or gradients); the positions
    computed over all micro-batches and DP ranks (see `_Plan`); for the actor, the |rollout - trainer| logprob
    totals of its forward passes."""
    loss_fn = _actor_loss if role == "actor" else _critic_loss
    dp = ps.get_data_parallel_world_size()
    sums: dict[str, float] = {}
    grad_norms: list[float] = []
    diff_sum, diff_max, diff_count = 0.0, 0.0, 0.0
    seq_sum, seq_max, seq_count = 0.0, 0.0, 0.0
    steps = skipped = 0
    token_counts = torch.zeros(4, dtype=torch.float64)  # computed, real, untrimmed, shared
    config = get_model_config(ddp)
    moe_layers = 0
    coeff = getattr(config, "moe_aux_loss_coeff", 0.0)
    if role == "actor" and config.num_moe_experts and (sum(coeff) if isinstance(coeff, list) else coeff) > 0:
        # a load-balancing loss to log; mindrl's builder gives megatron the MoE layers as a 0/1 list
        freq = config.moe_layer_freq
        moe_layers = sum(freq) if isinstance(freq, list) else -(-config.num_layers // freq)
    router = torch.zeros(2, dtype=torch.float64)  # load-balancing loss over this rank's micro-batches, their count
    take_load_balancing_loss()  # forward-only passes track nothing in eval; drop anything left from elsewhere
    expert_load = ExpertLoad(ddp, config.num_layers, config.num_moe_experts) if config.num_moe_experts else None
    replay = _replay_for(ddp, "replay") if role == "actor" and ROUTED_EXPERTS in shard else None
    ddp.train()
    minis = shard.split(num_mini_batches)
    if settings.shuffle_mini_batch and num_mini_batches > 1:
        # MindSpeed-RL's shuffle_mini_batch: one order per update, kept over its epochs; the scheduler's step count
        # is the same on every rank and is restored on resume, so the order is too
        gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + int(getattr(scheduler, "num_steps", 0)))
        minis = [minis[i] for i in torch.randperm(num_mini_batches, generator=gen).tolist()]
    for _ in range(epochs):
        for mini in minis:
            tokens, seqs = _global_counts(mini)
            # Global denominators (micro-batches are trimmed, so also the batch's R for the *-norm mode).
            agg = {
                "global_num_tokens": max(tokens, 1.0),
                "global_num_seqs": max(seqs, 1.0),
                "loss_scale_factor": float(settings.loss_scale_factor or mini["responses"].shape[1]),
                "dp_size": dp,
            }
            plan = _plan(ddp, mini, micro_batch_size)
            token_counts += torch.tensor(
                [plan.computed_tokens, plan.real_tokens, plan.untrimmed_tokens, plan.shared_tokens], dtype=torch.float64
            )

            def step(data_iterator, model, _n=len(plan.micro), _agg=agg):
                mb = next(data_iterator)
                if replay is not None:
                    _replay_targets(replay, mb)
                output, sliced = _forward(model, mb)
                return output, partial(loss_fn, mb, settings, _agg, _n, sliced)

            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            with replay if replay is not None else nullcontext():
                outs = _schedule(ddp, plan.micro, step, forward_only=False)
            if moe_layers:
                router += torch.tensor([take_load_balancing_loss(), float(len(plan.micro))], dtype=torch.float64)
            local: dict[str, float] = {}
            for out in outs:  # last stage only
                for k, v in out.items():
                    local[k] = max(local.get(k, 0.0), v.item()) if k.endswith("_max") else local.get(k, 0.0) + v.item()
            values = _reduce_metrics(local)
            if role == "actor":
                diff_sum += values.pop("_diff_sum")
                diff_max = max(diff_max, values.pop("_diff_max"))
                diff_count += tokens
                seq_sum += values.pop("_seq_diff_sum")
                seq_max = max(seq_max, values.pop("_seq_diff_max"))
                seq_count += seqs
            finite = all(math.isfinite(v) for v in values.values()) and _grads_finite(ddp)
            if not finite:
                skipped += 1
                continue
            around = step_context() if step_context is not None else nullcontext()
            with torch.profiler.record_function(OPTIMIZER_RANGE), around:  # the profile's summary counts it apart
                ok, grad_norm, _ = optimizer.step()
            if not ok:
                skipped += 1
                continue
            scheduler.step(increment=1)
            steps += 1
            grad_norms.append(float(grad_norm) if grad_norm is not None else 0.0)
            for k, v in values.items():
                sums[k] = sums.get(k, 0.0) + v
    metrics = {k: v / max(steps, 1) for k, v in sums.items()}
    metrics[f"{role}/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics[f"{role}/lr"] = float(optimizer.param_groups[0]["lr"])
    metrics[f"{role}/skipped_updates"] = float(skipped)
    if moe_layers:
        metrics["actor/moe_load_balancing_loss"] = _router_loss_mean(router, moe_layers)
    if replay is not None:  # how often the routers' own choice was the replayed one, over the model's world
        agree = replay.agreement.to(current_platform().device())
        if ps.get_tensor_model_parallel_rank() != 0 and not config.sequence_parallel:
            agree.zero_()
        torch.distributed.all_reduce(agree)
        metrics["actor/moe_replay_agreement"] = float(agree[0] / max(float(agree[1]), 1.0))
    if expert_load is not None:
        expert_load.close()
        metrics.update(expert_load_metrics(_routed_tokens(expert_load.counts, config), role))
    diff = LogprobDiff(diff_sum, diff_count, diff_max, seq_sum, seq_count, seq_max) if role == "actor" else None
    token_counts = token_counts.to(current_platform().device())
    torch.distributed.all_reduce(token_counts, group=ps.get_data_parallel_group())
    return UpdateResult(metrics, TokenCounts(*token_counts.tolist()), diff)


def _routed_tokens(counts: torch.Tensor, config) -> torch.Tensor:
    """Each rank's tokens per expert and layer summed over the model's world, each token counted once: TP ranks
    route their sequence-parallel slices, or all of them the same tokens without sequence parallelism (then TP rank
    0's count only)."""
    counts = counts.clone()
    if not config.sequence_parallel and ps.get_tensor_model_parallel_rank() != 0:
        counts.zero_()
    counts = counts.to(current_platform().device())
    torch.distributed.all_reduce(counts)
    return counts.cpu()


def _router_loss_mean(router: torch.Tensor, moe_layers: int) -> float:
    """The load-balancing loss per MoE layer and micro-batch of the update, the same on every rank: the ranks' shares
    (TP / CP ranks hold parts of a micro-batch's, pipeline stages their layers') summed over the model's world, over
    the micro-batches of every DP rank (each counted once: on its first TP, CP and pipeline rank)."""
    first = (ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    router = router.clone()
    if first != (0, 0, 0):
        router[1] = 0.0
    router = router.to(current_platform().device())
    torch.distributed.all_reduce(router)
    return float(router[0] / max(float(router[1]), 1.0) / moe_layers)


def _reduce_metrics(local: dict[str, float]) -> dict[str, float]:
    """The last pipeline stage's metric sums, summed over DP (maxima for keys ending in _max); the same dict on
    every rank of the model's world."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        src = torch.distributed.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        box = [local]
        torch.distributed.broadcast_object_list(box, src=src, group=group)
        local = box[0]
    keys = sorted(local)
    device = current_platform().device()
    sums = torch.tensor([0.0 if k.endswith("_max") else local[k] for k in keys], dtype=torch.float64, device=device)
    maxes = torch.tensor([local[k] if k.endswith("_max") else 0.0 for k in keys], dtype=torch.float64, device=device)
    group = ps.get_data_parallel_group()
    torch.distributed.all_reduce(sums, group=group)
    torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX, group=group)
    return {k: (m if k.endswith("_max") else v) for k, v, m in zip(keys, sums.tolist(), maxes.tolist())}
