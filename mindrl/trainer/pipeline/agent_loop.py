"""The agent-loop episode: generate, parse the turn's tool calls, run the tools, append their observations,
generate again, until a turn calls no tool or a limit ends the episode. The response is the policy's turns and the
observations in between, with `loss_mask` 0 exactly on the observation tokens (context the policy did not write).

The engines hold the policy's weights for the whole episode (loaded once, not once per turn). One engine call per turn
for every trajectory still running (the first with `sampling.n` samples per prompt, the
next ones with one continuation per trajectory; a turn that call cut at another trajectory's smaller room goes on
in one more), so the engine batches as in a one-turn rollout; a turn's tool
calls, every trajectory's, run together in one thread pool. Limits, as MindSpeed-RL names them:
- `max_total_response_length`: response tokens, policy turns and observations together. A turn is cut at it
  (finish_reason "length"); an observation that would reach it ends the episode instead of being appended.
- `max_tool_calls`: tool-call blocks per episode (a malformed block counts, it is answered); once reached, the
  episode ends at the next turn with calls.
- `max_parallel_calls`: blocks run per turn; the blocks after them are answered "not run".
- `max_tool_response_length` and `tool_response_truncate_side`: characters of each tool's output kept: `left` the
  first ones, `right` the last ones, `middle` both ends (MindSpeed-RL's meaning of the sides).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mindrl.agent.hermes import ParsedTurn, ToolCall, ToolCallError, parse_tool_calls
from mindrl.agent.tools import Tool, ToolError
from mindrl.config.rl import TOOL_RESPONSE_TRUNCATE_SIDES
from mindrl.rollout.base import RolloutSample
from mindrl.trainer.experience import Response
from mindrl.trainer.pipeline.episode import Episode

TRUNCATE_SIDES = TOOL_RESPONSE_TRUNCATE_SIDES
TRUNCATED = "...(truncated)"
FAILED = "Error: "
"""How a failed call's output starts (kept through truncation: `mindrl.rewards.retool` pays only for the others)."""


@dataclass(frozen=True)
class AgentLimits:
    max_tool_calls: int
    max_parallel_calls: int
    max_total_response_length: int
    max_tool_response_length: int
    tool_response_truncate_side: str = "middle"

    @classmethod
    def from_config(cls, rl, max_tokens: int) -> AgentLimits:
        """From rl_config's MindSpeed-RL keys; a key left unset takes MindSpeed-RL's recipe value (one call of one
        block, 256 characters kept from both ends) or, for the episode's length, one turn's `max_tokens`
        (generate_config.sampling_config.max_tokens)."""
        return cls(
            max_tool_calls=rl.max_tool_calls or 1,
            max_parallel_calls=rl.max_parallel_calls or 1,
            max_total_response_length=rl.max_total_response_length or max_tokens,
            max_tool_response_length=rl.max_tool_response_length or 256,
            tool_response_truncate_side=rl.tool_response_truncate_side or "middle",
        )

    def __post_init__(self) -> None:
        for f in ("max_tool_calls", "max_parallel_calls", "max_total_response_length", "max_tool_response_length"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"AgentLimits.{f}: must be an integer >= 1, got {v!r}")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"AgentLimits.tool_response_truncate_side: one of {TRUNCATE_SIDES}, "
                             f"got {self.tool_response_truncate_side!r}")  # fmt: skip


@dataclass(frozen=True)
class ChatFormat:
    """How an observation enters the context. Qwen2.5's ChatML: the assistant turn is closed (unless the model
    closed it), the tool outputs come as a user turn of `<tool_response>` blocks, and a new assistant turn opens."""

    turn_end: str = "<|im_end|>"
    observation_start: str = "\n<|im_start|>user\n"
    observation_end: str = "<|im_end|>\n<|im_start|>assistant\n"
    response_start: str = "<tool_response>\n"
    response_end: str = "\n</tool_response>"

    def observation(self, turn_text: str, outputs: Sequence[str]) -> str:
        close = "" if turn_text.endswith(self.turn_end) else self.turn_end
        body = "\n".join(f"{self.response_start}{o}{self.response_end}" for o in outputs)
        return f"{close}{self.observation_start}{body}{self.observation_end}"


def truncate_output(text: str, limit: int, side: str) -> tuple[str, bool]:
    """`text` cut to `limit` characters on `side` (see the module doc), marked; (text, whether it was cut)."""
    if len(text) <= limit:
        return text, False
    if side == "left":
        return text[:limit] + TRUNCATED, True
    if side == "right":
        return TRUNCATED + text[-limit:], True
    half = limit // 2
    return text[:half] + TRUNCATED + text[len(text) - (limit - half) :], True


@dataclass
class _Trajectory:
    prompt: list[int]
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    turns: int = 0
    tool_calls: int = 0
    pending: list[Any] = field(default_factory=list)
    """This turn's blocks to answer: (ToolCall | ToolCallError | str note)."""
    turn_text: str = ""
    outputs: list[str] = field(default_factory=list)
    budget: int | None = None
    """Partial rollout: the tokens this piece may still sample (None: unbounded)."""
    cut: RolloutSample | None = None
    """Partial rollout: set when the piece ends the episode unfinished: the turn written so far (empty at a turn's
    start)."""


@dataclass
class _Tally:
    """What the metrics count, over one `run` or over the `resume` pieces since `reset_metrics`."""

    stats: dict[str, Any] = field(default_factory=lambda: defaultdict(float))
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    ended: list[_Trajectory] = field(default_factory=list)
    """The episodes that ended."""

    def metrics(self) -> dict[str, float]:
        ended, stats = self.ended, self.stats
        n = max(len(ended), 1)
        out = {
            "agent/turns_mean": sum(t.turns for t in ended) / n,
            "agent/tool_calls_mean": sum(t.tool_calls for t in ended) / n,
            "agent/tool_calls": stats["calls"],
            "agent/tool_errors": stats["errors"],
            "agent/truncated_observations": stats["truncated"],
            "agent/length_stops": sum(t.finish_reason == "length" for t in ended),
        }
        for name, lat in self.latency.items():
            out[f"agent/{name}/calls"] = len(lat)
            out[f"agent/{name}/errors"] = stats[f"errors/{name}"]
            out[f"agent/{name}/latency_s_mean"] = sum(lat) / len(lat)
            out[f"agent/{name}/latency_s_max"] = max(lat)
        return out


class AgentLoop(Episode):
    """`engine`: `generate(prompts, sampling, seeds, timing) -> per prompt, its samples` and `awake(timing)`, the
    context in which its calls share one weight load (`engines.Engine`).
    `tokenizer`: an HF tokenizer (`encode(text, add_special_tokens=False)`, `decode(ids)` keeping special tokens).
    `tools`: by function name. `turn_stop`: a token that also ends a turn (`build.tool_call_end`). `metrics` holds the
    last run's (or the `resume` pieces' since `reset_metrics`): turns, tool calls, errors and latency per tool,
    truncated observations."""

    def __init__(
        self,
        engine,
        tokenizer,
        tools: dict[str, Tool],
        limits: AgentLimits,
        parser: Callable[[str], ParsedTurn] = parse_tool_calls,
        chat: ChatFormat = ChatFormat(),
        tool_workers: int = 16,
        turn_stop: int | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.tools, self.limits = engine, tokenizer, tools, limits
        self.parser, self.chat, self.tool_workers, self.turn_stop = parser, chat, tool_workers, turn_stop
        self.metrics: dict[str, float] = {}
        self._tally = _Tally()

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @staticmethod
    def _turn_seed(seed: int, turn: int, piece: int = 0) -> int:
        return (seed * 1_000_003 + turn * 7_919 + piece * 104_729) % (2**31 - 1)

    def run(self, prompts, sampling, seeds, timing) -> list[list[Response]]:
        if not prompts:
            self.metrics = {}
            return []
        with self.engine.awake(timing):  # the weights load into the engines once, for every turn
            return self._run(prompts, self._stop_at_calls(sampling), seeds, timing)

    def _stop_at_calls(self, sampling):
        stops = list(sampling.stop_token_ids or [])
        if self.turn_stop is not None and self.turn_stop not in stops:
            sampling = dataclasses.replace(sampling, stop_token_ids=[*stops, self.turn_stop])
        return sampling

    def _run(self, prompts, sampling, seeds, timing) -> list[list[Response]]:
        lim = self.limits
        first = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, lim.max_total_response_length))
        groups = self.engine.generate(prompts, first, seeds, timing)
        trajs = [[_Trajectory(list(p), s * sampling.n + j) for j in range(sampling.n)] for p, s in zip(prompts, seeds)]
        tally = _Tally()
        active = [(t, s) for ts, g in zip(trajs, groups) for t, s in zip(ts, g)]
        turn = 0
        while active:
            turn += 1
            calling = [t for t, sample in active if self._take_turn(t, sample, tally.stats)]
            going = self._act(calling, tally, timing)
            if not going:
                break
            active = list(zip(going, self._next_turn(going, sampling, turn, timing)))
        tally.ended = [t for ts in trajs for t in ts]
        self.metrics = tally.metrics()
        return [[Response(t.token_ids, t.logprobs, t.finish_reason, [], t.loss_mask) for t in ts] for ts in trajs]

    def _act(self, calling: list[_Trajectory], tally: _Tally, timing) -> list[_Trajectory]:
        """Runs the turn's tool calls of `calling` and appends their observations; the trajectories that go on."""
        if not calling:
            return []
        t0 = time.perf_counter()
        self._run_tools(calling, tally.stats, tally.latency)
        timing["timing/tools"] = timing.get("timing/tools", 0.0) + time.perf_counter() - t0
        return [t for t in calling if self._observe(t, tally.stats)]

    # -------------------------------------------------------------------------------------- partial rollout
    def limit(self, sampling) -> int:
        return self.limits.max_total_response_length

    def reset_metrics(self) -> None:
        self._tally = _Tally()
        self.metrics = {}

    def resume(self, cuts, sampling, budget, seeds, version, timing) -> None:
        """A piece of each episode: its turn goes on where the last piece cut it (the context is the prompt and every
        token so far), and the turns after it, until the episode ends or has sampled `budget` tokens, mid-turn or at a
        turn's start. A turn's tool calls are parsed from the whole turn, and run when it ends; their observation is
        appended (loss mask 0) without spending the budget, so an episode ends within
        ceil(max_total_response_length / budget) pieces."""
        tally = self._tally
        sampling = self._stop_at_calls(sampling)
        trajs, carried = [], []
        for (prompt, p), seed in zip(cuts, seeds):
            k, mask = p.turn_start, p.loss_mask if p.loss_mask is not None else [1] * len(p.token_ids)
            trajs.append(_Trajectory(list(prompt), seed, p.token_ids[:k], p.logprobs[:k], mask[:k], turns=p.turns,
                                     tool_calls=p.tool_calls, budget=budget))  # fmt: skip
            carried.append(RolloutSample(p.token_ids[k:], p.logprobs[k:], "length"))
        going, turn = trajs, 0
        with self.engine.awake(timing):
            while going:
                turn += 1
                calling = []
                for t, sample in zip(going, self._next_turn(going, sampling, turn, timing, carried)):
                    if self._cut_by_piece(t, sample, sampling.max_tokens):
                        t.cut = sample
                    elif self._take_turn(t, sample, tally.stats):
                        calling.append(t)
                carried = None
                going = []
                for t in self._act(calling, tally, timing):
                    if t.budget:
                        going.append(t)
                    else:  # the piece is spent at a turn's start
                        t.cut = RolloutSample([], [], "length")
        for t, (_, p) in zip(trajs, cuts):
            turn_ids = t.cut.token_ids if t.cut is not None else []
            ids = t.token_ids + list(turn_ids)
            p.versions += [version] * (len(ids) - len(p.token_ids))
            p.token_ids, p.loss_mask = ids, t.loss_mask + [1] * len(turn_ids)
            p.logprobs = t.logprobs + (list(t.cut.logprobs) if t.cut is not None else [])
            p.turns, p.tool_calls, p.turn_start = t.turns, t.tool_calls, len(t.token_ids)
            p.finish_reason = None if t.cut is not None else t.finish_reason
            if t.cut is None:
                tally.ended.append(t)
        self.metrics = tally.metrics()

    def _cut_by_piece(self, t: _Trajectory, turn: RolloutSample, max_tokens: int) -> bool:
        """Whether the piece's budget, not the turn's nor the episode's length, stopped `turn`: it goes on next piece."""
        room = self.limits.max_total_response_length - len(t.token_ids)
        n = len(turn.token_ids)
        return turn.finish_reason == "length" and t.budget == 0 and n < min(max_tokens, room)

    def _next_turn(self, going: list[_Trajectory], sampling, turn: int, timing, carried=None) -> list[RolloutSample]:
        """Each trajectory's next turn (or, partial rollout, the rest of its `carried` turn), at most
        `sampling.max_tokens` tokens, its own room in the episode and its piece's budget. One engine call serves them
        all with the smallest of those bounds (the engine takes one max_tokens per call, and a context plus max_tokens
        must fit max_model_len); a trajectory that call stopped short of its own bound continues its turn in the next
        call, so no turn is cut for another's lack of room."""
        lim = self.limits
        turns = [RolloutSample(list(c.token_ids), list(c.logprobs), "length") for c in carried] if carried else [
            RolloutSample([], [], "stop") for _ in going]  # fmt: skip
        pending = list(range(len(going)))
        piece = 0
        while pending:
            bounds = [min(sampling.max_tokens - len(turns[i].token_ids),
                          lim.max_total_response_length - len(going[i].token_ids) - len(turns[i].token_ids),
                          going[i].budget if going[i].budget is not None else sampling.max_tokens)
                      for i in pending]  # fmt: skip
            step = min(bounds)
            nxt = dataclasses.replace(sampling, n=1, max_tokens=step)
            out = self.engine.generate([going[i].prompt + going[i].token_ids + turns[i].token_ids for i in pending],
                                       nxt, [self._turn_seed(going[i].seed, turn, piece) for i in pending],
                                       timing)  # fmt: skip
            more = []
            for i, bound, [sample] in zip(pending, bounds, out):
                turns[i].token_ids += sample.token_ids
                turns[i].logprobs += sample.logprobs
                turns[i].finish_reason = sample.finish_reason
                if going[i].budget is not None:
                    going[i].budget -= len(sample.token_ids)
                if sample.finish_reason == "length" and len(sample.token_ids) == step < bound:
                    more.append(i)
            pending, piece = more, piece + 1
        return turns

    def _take_turn(self, t: _Trajectory, sample, stats) -> bool:
        """Appends the policy's turn (cut to the episode's room); whether the episode goes on to run tools."""
        lim = self.limits
        room = lim.max_total_response_length - len(t.token_ids)
        ids, lps = list(sample.token_ids)[:room], list(sample.logprobs)[:room]
        t.turns += 1
        t.token_ids += ids
        t.logprobs += lps
        t.loss_mask += [1] * len(ids)
        t.finish_reason = sample.finish_reason
        if len(sample.token_ids) > room or len(t.token_ids) >= lim.max_total_response_length:
            t.finish_reason = "length"
            return False
        parsed = self.parser(self._decode(ids))
        if not parsed.any or t.tool_calls >= lim.max_tool_calls:
            return False
        budget = min(lim.max_parallel_calls, lim.max_tool_calls - t.tool_calls)
        t.pending = list(parsed.blocks[:budget])
        t.tool_calls += len(t.pending)
        skipped = len(parsed.blocks) - budget
        if skipped > 0:
            stats["skipped"] += skipped
            t.pending.append(f"Error: {skipped} more tool call(s) not run: at most {budget} in this turn")
        t.turn_text = self._decode(ids)
        return True

    def _call(self, block) -> tuple[str, str | None, bool, float]:
        """(output text, tool name or None, failed, seconds) of one block."""
        if isinstance(block, str):
            return block, None, False, 0.0
        if isinstance(block, ToolCallError):
            return f"Error: malformed tool call ({block.reason})", None, True, 0.0
        assert isinstance(block, ToolCall)
        tool = self.tools.get(block.name)
        if tool is None:
            return f"Error: no tool named {block.name!r} (tools: {', '.join(sorted(self.tools))})", None, True, 0.0
        bad = tool.check_arguments(block.arguments)
        if bad:
            return f"Error: bad arguments for {block.name}: {bad}", block.name, True, 0.0
        t0 = time.perf_counter()
        try:
            return tool.execute(block.arguments), block.name, False, time.perf_counter() - t0
        except ToolError as e:
            return f"Error: {e}", block.name, True, time.perf_counter() - t0
        except Exception as e:  # a tool's own bug must not end the rollout; the model sees it as a failed call
            return f"Error: the tool failed ({type(e).__name__}: {e})", block.name, True, time.perf_counter() - t0

    def _run_tools(self, calling: list[_Trajectory], stats, latency) -> None:
        jobs = [(t, b) for t in calling for b in t.pending]
        with ThreadPoolExecutor(max_workers=max(1, min(self.tool_workers, len(jobs)))) as pool:
            results = list(pool.map(lambda job: self._call(job[1]), jobs))
        outputs: dict[int, list[str]] = defaultdict(list)
        for (t, b), (text, name, failed, seconds) in zip(jobs, results):
            if not isinstance(b, str):
                stats["calls"] += 1
                stats["errors"] += failed
            if name is not None:
                latency[name].append(seconds)
                stats[f"errors/{name}"] += failed
            keep = FAILED if failed and text.startswith(FAILED) else ""  # retool_reward tells failures by it
            text, cut = truncate_output(text[len(keep) :], max(1, self.limits.max_tool_response_length - len(keep)),
                                        self.limits.tool_response_truncate_side)  # fmt: skip
            text = keep + text
            stats["truncated"] += cut
            outputs[id(t)].append(text)
        for t in calling:
            t.outputs = outputs[id(t)]

    def _observe(self, t: _Trajectory, stats) -> bool:
        """Appends the observation (loss mask 0); False when it would reach the episode's length limit."""
        ids = self._encode(self.chat.observation(t.turn_text, t.outputs))
        if len(t.token_ids) + len(ids) >= self.limits.max_total_response_length:
            t.finish_reason = "length"
            return False
        t.token_ids += ids
        t.logprobs += [0.0] * len(ids)
        t.loss_mask += [0] * len(ids)
        return True
