"""The agent-loop episode (pipeline/agent_loop.py), in-process.

`ScriptedEngine` is a test double for the engine: a deterministic `generate` that answers each context from a
script (a real engine's tokens are random). Everything else is real: the episode's loop, limits and masks, the
hermes parser, the calculator tool, and a real byte-level BPE ChatML tokenizer (tools/make_tiny_model.py), whose
encode/decode the masks are checked against token by token."""

from __future__ import annotations

import contextlib

import pytest

from mindrl.agent.hermes import ToolCall, format_tool_call
from mindrl.agent.tools import CalculatorTool, Tool
from mindrl.config.settings import SamplingConfig
from mindrl.rollout.base import RolloutSample
from mindrl.trainer.experience import make_batch
from mindrl.trainer.pipeline.agent_loop import TRUNCATED, AgentLimits, AgentLoop, ChatFormat, truncate_output
from mindrl.trainer.pipeline.episode import Episode
from tests.agent.test_tools import CALC_SCHEMA

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tools.make_tiny_model import make_tokenizer

    out = str(tmp_path_factory.mktemp("agent_tok"))
    make_tokenizer(out, vocab_size=512)
    return AutoTokenizer.from_pretrained(out)


def calc(expr: str) -> str:
    return format_tool_call(ToolCall("calculator", {"expression": expr}))


class ScriptedEngine:
    """Test double for `engines.Engine`: `script(context_text, turn, sample_index)` gives the turn's text; its tokens
    get logprob -(k+1)/100 at position k, and a reply longer than max_tokens is cut there ("length"). `wakes` counts
    the weight loads as the real one's `awake` does: once per `awake`, else once per call."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls, self.wakes, self.inside = tok, script, [], 0, False

    @contextlib.contextmanager
    def awake(self, timing):
        self.wakes, self.inside = self.wakes + 1, True
        yield
        self.inside = False

    def generate(self, prompts, sampling, seeds, timing):
        self.calls.append((len(prompts), sampling.n, sampling.max_tokens))
        self.wakes += not self.inside
        out = []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            group = []
            for j in range(sampling.n):
                ids = self.tok.encode(
                    self.script(text, text.count("<|im_start|>assistant"), j), add_special_tokens=False
                )
                cut = len(ids) > sampling.max_tokens
                ids = ids[: sampling.max_tokens]
                group.append(RolloutSample(ids, [-(k + 1) / 100 for k in range(len(ids))], "length" if cut else "stop"))
            out.append(group)
        return out


def limits(**kw):
    base = dict(max_tool_calls=4, max_parallel_calls=2, max_total_response_length=400, max_tool_response_length=200)
    return AgentLimits(**{**base, **kw})


def loop(tok, script, tools=None, **kw):
    engine = ScriptedEngine(tok, script)
    tools = {"calculator": CalculatorTool({}, CALC_SCHEMA)} if tools is None else tools
    return AgentLoop(engine, tok, tools, limits(**kw)), engine


def prompt(tok, q="What is 123*456?"):
    return tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def pieces(tok, response):
    """The response split into runs of equal mask: [(mask, text)]."""
    runs, cur, ids = [], None, []
    for t, m in zip(response.token_ids, response.loss_mask):
        if m != cur and ids:
            runs.append((cur, tok.decode(ids, skip_special_tokens=False)))
            ids = []
        cur = m
        ids.append(t)
    if ids:
        runs.append((cur, tok.decode(ids, skip_special_tokens=False)))
    return runs


def test_the_loop_is_an_episode():
    assert issubclass(AgentLoop, Episode)


def test_two_turns_mask_is_zero_exactly_on_the_observation(tok):
    turn1 = "Let me compute. " + calc("123*456")
    turn2 = "So the answer is \\boxed{56088}." + END

    def script(text, turn, j):
        return turn1 if turn == 1 else turn2

    ep, engine = loop(tok, script)
    [[r]] = ep.run([prompt(tok)], SamplingConfig(max_tokens=100), [7], {})
    obs = f"{END}\n<|im_start|>user\n<tool_response>\n56088\n</tool_response>{END}\n<|im_start|>assistant\n"
    t1, o, t2 = (tok.encode(x, add_special_tokens=False) for x in (turn1, obs, turn2))
    # token by token: the policy's turns as sampled, the observation as encoded on its own
    assert r.token_ids == t1 + o + t2
    assert r.loss_mask == [1] * len(t1) + [0] * len(o) + [1] * len(t2)
    assert r.logprobs == [-(k + 1) / 100 for k in range(len(t1))] + [0.0] * len(o) + [
        -(k + 1) / 100 for k in range(len(t2))
    ]
    assert pieces(tok, r) == [(1, turn1), (0, obs), (1, turn2)]
    assert r.finish_reason == "stop"
    # the second call continues the context: prompt + turn + observation, one sample, the room left
    assert engine.calls == [(1, 1, 100), (1, 1, 100)]
    assert engine.wakes == 1  # both turns from one weight load
    assert ep.metrics["agent/turns_mean"] == 2 and ep.metrics["agent/tool_calls"] == 1
    assert ep.metrics["agent/tool_errors"] == 0 and ep.metrics["agent/calculator/calls"] == 1
    assert ep.metrics["agent/calculator/latency_s_mean"] >= 0


def test_make_batch_keeps_observations_in_context_and_out_of_the_loss(tok):
    def script(text, turn, j):
        return calc("2+2") if turn == 1 else "4" + END

    ep, _ = loop(tok, script)
    p = prompt(tok)
    groups = ep.run([p], SamplingConfig(max_tokens=200), [0], {})
    batch = make_batch([p], groups, 1, tok.pad_token_id)
    r = groups[0][0]
    resp = batch["response_mask"][0, : len(r.token_ids)].tolist()
    assert resp == r.loss_mask and 0 in resp
    assert batch["attention_mask"][0].sum().item() == len(p) + len(r.token_ids)


def test_group_of_n_each_sample_follows_its_own_path(tok):
    """Sample 0 answers at once, sample 1 calls a tool: one engine call for the first turn (n=2), one for the only
    trajectory still running."""

    def script(text, turn, j):
        if "<tool_response>" in text:
            return "done" + END
        return ("no tool" + END) if j == 0 else calc("6*7")

    ep, engine = loop(tok, script)
    [[a, b]] = ep.run([prompt(tok)], SamplingConfig(max_tokens=200, n=2), [3], {})
    assert set(a.loss_mask) == {1} and 0 in b.loss_mask
    assert "42" in tok.decode(b.token_ids)
    assert engine.calls == [(1, 2, 200), (1, 1, 200)]
    assert ep.metrics["agent/turns_mean"] == 1.5 and ep.metrics["agent/tool_calls_mean"] == 0.5


@pytest.mark.parametrize(
    "bad, says",
    [
        ("<tool_call>{not json}</tool_call>", "Error: malformed tool call (not JSON"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "Error: no tool named 'search'"),
        ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>', "Error: bad arguments"),
        (calc("1/0"), "Error: division by zero"),
        ("<tool_call>{", "Error: malformed tool call (<tool_call> without </tool_call>)"),
    ],
)
def test_a_bad_call_gets_an_error_observation_and_the_episode_goes_on(tok, bad, says):
    def script(text, turn, j):
        return bad if turn == 1 else "sorry" + END

    ep, _ = loop(tok, script)
    [[r]] = ep.run([prompt(tok)], SamplingConfig(max_tokens=200), [0], {})
    runs = pieces(tok, r)
    assert [m for m, _ in runs] == [1, 0, 1]
    assert says in runs[1][1] and runs[2][1] == "sorry" + END
    assert ep.metrics["agent/tool_errors"] == 1 and ep.metrics["agent/tool_calls"] == 1


def test_a_tool_that_raises_is_an_error_observation_not_a_crash(tok):
    class Broken(Tool):
        def execute(self, arguments):
            raise RuntimeError("boom")

    schema = {**CALC_SCHEMA, "function": {**CALC_SCHEMA["function"], "name": "broken"}}
    ep, _ = loop(tok, lambda text, turn, j: '<tool_call>{"name": "broken", "arguments": {"expression": "1"}}'
                 "</tool_call>" if turn == 1 else "ok" + END, tools={"broken": Broken({}, schema)})  # fmt: skip
    [[r]] = ep.run([prompt(tok)], SamplingConfig(max_tokens=200), [0], {})
    assert "Error: the tool failed (RuntimeError: boom)" in pieces(tok, r)[1][1]
    assert ep.metrics["agent/broken/errors"] == 1


def test_max_parallel_calls_runs_the_first_blocks_and_says_the_rest_were_not_run(tok):
    three = calc("1+1") + calc("2+2") + calc("3+3")
    ep, _ = loop(tok, lambda text, turn, j: three if turn == 1 else "ok" + END, max_parallel_calls=2)
    [[r]] = ep.run([prompt(tok)], SamplingConfig(max_tokens=200), [0], {})
    obs = pieces(tok, r)[1][1]
    assert "<tool_response>\n2\n</tool_response>\n<tool_response>\n4\n</tool_response>" in obs
    assert "6" not in obs and "1 more tool call(s) not run" in obs
    assert ep.metrics["agent/tool_calls"] == 2


def test_max_tool_calls_ends_the_episode_at_the_next_turn_with_calls(tok):
    ep, engine = loop(tok, lambda text, turn, j: calc(f"{turn}*10"), max_tool_calls=2, max_parallel_calls=1)
    [[r]] = ep.run([prompt(tok)], SamplingConfig(max_tokens=200), [0], {})
    runs = pieces(tok, r)
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]  # two answered calls, the third turn's call is not run
    assert "10" in runs[1][1] and "20" in runs[3][1]
    assert len(engine.calls) == 3 and ep.metrics["agent/tool_calls"] == 2


def test_max_total_response_length_cuts_the_turn_and_every_later_call_gets_the_room_left(tok):
    turn1 = calc("1+1")
    n1 = len(tok.encode(turn1, add_special_tokens=False))
    long = "word " * 200
    ep, engine = loop(tok, lambda text, turn, j: turn1 if turn == 1 else long, max_total_response_length=n1 + 120)
    [[r]] = ep.run([prompt(tok)], SamplingConfig(max_tokens=500), [0], {})
    assert len(r.token_ids) == n1 + 120 and r.finish_reason == "length"
    n_obs = r.loss_mask.count(0)
    assert 0 < n_obs < 120 and r.loss_mask == [1] * n1 + [0] * n_obs + [1] * (120 - n_obs)
    assert engine.calls[0][2] == n1 + 120 and engine.calls[1][2] == 120 - n_obs
    assert ep.metrics["agent/length_stops"] == 1


def test_an_observation_that_would_reach_the_limit_ends_the_episode_without_it(tok):
    turn1 = calc("1+1")
    n1 = len(tok.encode(turn1, add_special_tokens=False))
    ep, engine = loop(tok, lambda text, turn, j: turn1, max_total_response_length=n1 + 5)
    [[r]] = ep.run([prompt(tok)], SamplingConfig(max_tokens=500), [0], {})
    assert r.loss_mask == [1] * n1 and r.finish_reason == "length" and len(engine.calls) == 1


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_long_tool_outputs_are_truncated_on_the_configured_side(tok, side):
    digits = "1" + "0" * 80  # 10**80: 81 characters
    ep, _ = loop(tok, lambda text, turn, j: calc("10**80") if turn == 1 else "ok" + END,
                 max_tool_response_length=20, tool_response_truncate_side=side)  # fmt: skip
    [[r]] = ep.run([prompt(tok)], SamplingConfig(max_tokens=200), [0], {})
    kept, cut = truncate_output(digits, 20, side)
    assert cut and f"<tool_response>\n{kept}\n</tool_response>" in pieces(tok, r)[1][1]
    assert ep.metrics["agent/truncated_observations"] == 1


def test_a_failed_calls_output_keeps_its_error_mark_through_truncation(tok):
    """retool_reward pays only for calls whose observation does not start with "Error: "; a right-side cut keeps it."""
    ep, _ = loop(tok, lambda text, turn, j: calc("1/0") if turn == 1 else "ok" + END,
                 max_tool_response_length=12, tool_response_truncate_side="right")  # fmt: skip
    [[r]] = ep.run([prompt(tok)], SamplingConfig(max_tokens=200), [0], {})
    assert "<tool_response>\nError: " + TRUNCATED in pieces(tok, r)[1][1]
    assert ep.metrics["agent/tool_errors"] == 1 and ep.metrics["agent/truncated_observations"] == 1


def test_truncate_output_sides():
    text = "abcdefghij"
    assert truncate_output(text, 10, "left") == (text, False)
    assert truncate_output(text, 4, "left") == ("abcd" + TRUNCATED, True)
    assert truncate_output(text, 4, "right") == (TRUNCATED + "ghij", True)
    assert truncate_output(text, 5, "middle") == ("ab" + TRUNCATED + "hij", True)


def test_the_turn_is_closed_once_when_the_model_closed_it(tok):
    chat = ChatFormat()
    assert chat.observation("x" + END, ["1"]).startswith("\n<|im_start|>user\n")
    assert chat.observation("x", ["1"]).startswith(END + "\n<|im_start|>user\n")


def test_trajectories_of_several_prompts_run_their_tools_together_and_the_seeds_are_per_trajectory(tok):
    seen = []

    class Recording(ScriptedEngine):
        def generate(self, prompts, sampling, seeds, timing):
            seen.append(list(seeds))
            return super().generate(prompts, sampling, seeds, timing)

    def script(text, turn, j):
        return calc("3*3") if turn == 1 else "ok" + END

    engine = Recording(tok, script)
    ep = AgentLoop(engine, tok, {"calculator": CalculatorTool({}, CALC_SCHEMA)}, limits())
    timing = {}
    groups = ep.run([prompt(tok, "a"), prompt(tok, "b")], SamplingConfig(max_tokens=200, n=2), [5, 9], timing)
    assert [len(g) for g in groups] == [2, 2] and ep.metrics["agent/tool_calls"] == 4
    assert seen[0] == [5, 9] and len(seen[1]) == 4 and len(set(seen[1])) == 4
    assert timing["timing/tools"] >= 0


@pytest.mark.parametrize(
    "kw, says",
    [(dict(max_tool_calls=0), "max_tool_calls"), (dict(tool_response_truncate_side="up"), "truncate_side")],
)
def test_bad_limits_are_refused(kw, says):
    with pytest.raises(ValueError, match=says):
        limits(**kw)


def test_observation_tokens_carry_no_gradient_and_no_token_count(tok):
    """The episode's masks through make_batch into GRPO's advantages and the PPO loss (algorithms/, the same
    functions the update calls): the loss's gradient is exactly 0 on every observation token and nonzero on every
    policy token, and token-mean divides by the policy tokens only."""
    import torch

    from mindrl.algorithms.advantages import compute_grpo_outcome_advantage
    from mindrl.algorithms.losses import count_tokens_and_seqs, policy_loss

    def script(text, turn, j):
        if "<tool_response>" in text:
            return "\\boxed{42}" + END
        return ("\\boxed{41}" + END) if j == 0 else calc("6*7")

    ep, _ = loop(tok, script)
    p = prompt(tok)
    groups = ep.run([p], SamplingConfig(max_tokens=200, n=2), [1], {})
    assert all(r.loss_mask[-1] == 1 for r in groups[0])  # an episode ends on a policy token: the reward's position
    batch = make_batch([p], groups, 2, tok.pad_token_id)
    mask = batch["response_mask"].float()
    policy = torch.zeros_like(mask)
    for row, r in enumerate(groups[0]):
        policy[row, : len(r.loss_mask)] = torch.tensor(r.loss_mask, dtype=torch.float)
    assert torch.equal(mask, policy) and (mask == 0).any()
    assert count_tokens_and_seqs(mask)[0] == sum(sum(r.loss_mask) for r in groups[0])

    rewards = torch.zeros_like(mask)
    for row, r in enumerate(groups[0]):
        rewards[row, len(r.loss_mask) - 1] = [0.0, 1.0][row]
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, [0, 0])
    old = torch.linspace(-2.0, -0.5, mask.numel()).reshape(mask.shape).double()
    new = (old + 0.01).requires_grad_()
    loss, _ = policy_loss(old, new, adv.double(), mask.double())
    loss.backward()
    obs = (mask == 0) & (batch["attention_mask"][:, len(p) :] == 1)  # in the context, out of the loss
    assert obs.any() and torch.all(new.grad[obs] == 0)
    assert torch.all(new.grad[mask == 1] != 0)
    per_token = -adv.double() * torch.exp(new.detach() - old)
    assert loss.item() == pytest.approx((per_token * mask).sum().item() / mask.sum().item(), rel=1e-12)


def test_limits_from_the_config_keys(tmp_path):
    from mindrl.config import load_config
    from tests.config.test_multi_turn_config import _cfg

    cfg = load_config("cfg", config_path=_cfg(tmp_path, total=300, side="left"))
    lim = AgentLimits.from_config(cfg.rl_config, cfg.generate_config.sampling_config.max_tokens)
    assert lim == AgentLimits(1, 1, 300, 256, "left")
    default = load_config("grpo_tiny_cpu")
    lim = AgentLimits.from_config(default.rl_config, default.generate_config.sampling_config.max_tokens)
    assert lim == AgentLimits(1, 1, default.generate_config.sampling_config.max_tokens, 256, "middle")


def test_no_prompts_no_engine_call(tok):
    ep, engine = loop(tok, lambda text, turn, j: "x")
    assert ep.run([], SamplingConfig(), [], {}) == [] and engine.calls == []


def test_a_turn_is_never_cut_for_another_trajectorys_lack_of_room(tok):
    """Trajectories with different room left share one engine call per turn (capped at the smallest room, so that no
    context + max_tokens passes the engine's length); the one with more room continues its turn in another call."""
    answer = tok.encode("The answer is \\boxed{12345678}." + END, add_special_tokens=False)
    opened = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    calls = []

    class Continuing:
        def awake(self, timing):
            return contextlib.nullcontext()

        def generate(self, prompts, sampling, seeds, timing):
            calls.append([len(p) + sampling.max_tokens for p in prompts])
            out = []
            for p in prompts:
                text = tok.decode(p, skip_special_tokens=False)
                if "<tool_response>" not in text:  # the first turn: a short or a long call
                    ids = [tok.encode(calc("1+1" if j == 0 else "+".join(["1"] * 12)), add_special_tokens=False)
                           for j in range(sampling.n)]  # fmt: skip
                else:  # the answer, continued where the context's last turn stopped
                    start = max(i + len(opened) for i in range(len(p)) if p[i : i + len(opened)] == opened)
                    ids = [answer[len(p) - start :]]
                group = []
                for x in ids:
                    cut = len(x) > sampling.max_tokens
                    x = x[: sampling.max_tokens]
                    group.append(RolloutSample(x, [-0.5] * len(x), "length" if cut else "stop"))
                out.append(group)
            return out

    p = prompt(tok)
    long_call = len(tok.encode(calc("+".join(["1"] * 12)), add_special_tokens=False))
    obs = len(tok.encode(ChatFormat().observation(calc("1"), ["2"]), add_special_tokens=False))
    total = long_call + obs + len(answer) // 2  # the long-call episode has room for half the answer
    ep = AgentLoop(Continuing(), tok, {"calculator": CalculatorTool({}, CALC_SCHEMA)},
                   limits(max_total_response_length=total))  # fmt: skip
    [[short, long]] = ep.run([p], SamplingConfig(max_tokens=total, n=2), [0], {})
    assert all(n <= len(p) + total for call in calls for n in call), calls  # every context fits
    assert len(calls) == 3  # the first turn, the second for both, its continuation for the one with room
    assert short.finish_reason == "stop" and short.token_ids[-len(answer) :] == answer
    assert long.finish_reason == "length" and len(long.token_ids) <= total


def test_a_search_calls_documents_land_in_the_context_outside_the_loss(tok, tmp_path):
    """The search tool against mindrl's retrieval server (in a thread): the served documents are the observation,
    in the context with loss mask 0; a second call to a service that is gone is an error observation."""
    from mindrl.agent.tools import SearchTool
    from tests.agent.test_search import SEARCH_SCHEMA, serving, write_corpus

    query = format_tool_call(ToolCall("search", {"query_list": ["volcano"]}))

    def script(text, turn, j):
        return ("Let me look it up. " + query) if turn == 1 else "\\boxed{Etna}" + END

    with serving(write_corpus(tmp_path / "corpus.jsonl")) as url:
        search = SearchTool({"retrieval_service_url": url, "topk": 1}, SEARCH_SCHEMA)
        ep, _ = loop(tok, script, tools={"search": search})
        [[r]] = ep.run([prompt(tok, "Which volcano erupts most?")], SamplingConfig(max_tokens=300), [0], {})
    doc = "Doc 1 (Title: Etna)\netna volcano sicily volcano eruption volcano"
    obs = f"{END}\n<|im_start|>user\n<tool_response>\n{doc}\n</tool_response>{END}\n<|im_start|>assistant\n"
    assert pieces(tok, r) == [(1, "Let me look it up. " + query), (0, obs), (1, "\\boxed{Etna}" + END)]
    assert ep.metrics["agent/search/calls"] == 1 and ep.metrics["agent/tool_errors"] == 0

    ep, _ = loop(tok, script, tools={"search": search})  # the server is shut down now
    [[r]] = ep.run([prompt(tok)], SamplingConfig(max_tokens=300), [0], {})
    [(_, said)] = [(m, text) for m, text in pieces(tok, r) if m == 0]
    assert "<tool_response>\nError: the retrieval service at" in said and "did not answer" in said
    assert ep.metrics["agent/search/errors"] == 1


class TurnEngine:
    """Test double for the engine that continues a cut turn as a real engine does: the turn being written is the
    context's tokens after its last assistant opener; `script(context before the turn, turn number)` gives the whole
    turn, and the reply is the rest of it, up to max_tokens ("length" if cut there), with logprob -(k+1)/100 at the
    turn's token k: a turn sampled in pieces has the tokens and logprobs of the turn sampled at once."""

    def __init__(self, tok, script):
        self.tok, self.script = tok, script
        self.opener = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def awake(self, timing):
        return contextlib.nullcontext()

    def generate(self, prompts, sampling, seeds, timing):
        out, w = [], len(self.opener)
        for p in prompts:
            start = max(i + w for i in range(len(p)) if p[i : i + w] == self.opener)
            before, written = self.tok.decode(p[:start], skip_special_tokens=False), p[start:]
            turn = self.script(before, before.count("<|im_start|>assistant"))
            whole = self.tok.encode(turn, add_special_tokens=False)
            assert whole[: len(written)] == written, "a continuation must extend the turn written so far"
            rest = whole[len(written) : len(written) + sampling.max_tokens]
            lps = [-(k + 1) / 100 for k in range(len(written), len(written) + len(rest))]
            done = len(written) + len(rest) == len(whole)
            out.append([RolloutSample(rest, lps, "stop" if done else "length") for _ in range(sampling.n)])
        return out


def calls_script(text: str, turn: int) -> str:
    """The question says how many tool calls its episode makes ("Use K tools"); then it answers."""
    k = int(text.split("Use ")[1][0])
    return ("Let me compute. " + calc(f"{turn}*111")) if turn <= k else f"So \\boxed{{{k * 111}}}." + END


@pytest.mark.parametrize("piece", [7, 23, "turn"])
def test_partial_rollout_cuts_episodes_and_resumes_them_as_if_never_cut_and_exactly_from_its_state(tok, piece):
    """The agent loop under partial rollout (pieces of 7 or 23 tokens, or exactly the first turn's length: cut
    mid-turn, and at a turn's start after its observation): every response is the one sampled straight (tokens, loss
    mask 0 exactly on the observations, logprobs), its tokens stamped with the iteration that sampled them, and a pool
    rebuilt from its JSON state (the checkpoint's) with a fresh episode continues exactly."""
    import json

    import torch

    from mindrl.data.prompt_dataset import PromptBatch
    from mindrl.trainer.pipeline.partial import PartialRollout, PartialSchedule
    from mindrl.trainer.pipeline.schedule import Seeds, Sync

    first_turn = len(tok.encode("Let me compute. " + calc("1*111"), add_special_tokens=False))
    size = first_turn if piece == "turn" else piece
    split = -(-600 // size)  # the episode limit a multiple of the piece: pieces of exactly `size`
    sampling = SamplingConfig(max_tokens=150, n=2)
    asks = [0, 2, 0, 1]  # tool calls per prompt: two batches of two, the short episodes end first

    def batches(start=0):
        for b in range(start, 2):
            rows = [prompt(tok, f"Use {asks[i]} tools.") for i in (2 * b, 2 * b + 1)]
            idx = [2 * b, 2 * b + 1]
            labels = {"labels": [torch.tensor([i]) for i in idx]}
            yield PromptBatch([torch.tensor(r) for r in rows], torch.tensor(idx), labels)

    def schedule(loader, state=None):
        ep = AgentLoop(TurnEngine(tok, calls_script), tok, {"calculator": CalculatorTool({}, CALC_SCHEMA)},
                       limits(max_total_response_length=size * split))  # fmt: skip
        pool = PartialRollout(2, sampling, split, 2, 2, seed=0, limit=ep.limit(sampling))
        if state is not None:
            pool.load_state_dict(state, 1)
        return PartialSchedule(pool, Sync(loader, ep, sampling, Seeds(0, 2)))

    sched = schedule(list(batches()))
    it1 = sched.next(1, 0, {})
    state = json.loads(json.dumps(sched.state_dict()["partial_rollout"]))  # what trainer_state.json holds
    it2 = sched.next(2, 0, {})
    cut = [r for g in state["pool"] for r in g["responses"] if r["finish_reason"] is None]
    assert len(cut) == 4 and all(r["token_ids"] for r in cut)  # the two longer prompts' episodes, in flight
    assert all(len(r["versions"]) == len(r["loss_mask"]) == len(r["token_ids"]) for r in cut)
    if piece == "turn":  # the first turn and its observation fit the piece: cut at the second turn's start
        assert all(r["turn_start"] == len(r["token_ids"]) and r["turns"] == 1 for r in cut), cut
        assert all(r["loss_mask"][-1] == 0 for r in cut)
    else:
        assert all(r["turn_start"] < len(r["token_ids"]) for r in cut)  # cut mid-turn
    # the resumed pool (a fresh episode and engine, the loader at the state's batch) gives the same iteration 2
    again = schedule(list(batches(state["drawn_batches"])), state).next(2, 0, {})
    timeless = lambda m: {k: v for k, v in m.items() if "latency" not in k}  # noqa: E731
    assert (again.prompt_ids, again.responses, again.labels) == (it2.prompt_ids, it2.responses, it2.labels)
    assert timeless(again.metrics) == timeless(it2.metrics)

    straight = AgentLoop(TurnEngine(tok, calls_script), tok, {"calculator": CalculatorTool({}, CALC_SCHEMA)},
                         limits(max_total_response_length=size * split))  # fmt: skip
    for it, gen in enumerate((it1, it2), start=1):
        for p, group in zip(gen.prompt_ids, gen.responses):
            [want] = straight.run([p], sampling, [0], {})
            for r, w in zip(group, want):
                assert (r.token_ids, r.loss_mask, r.logprobs, r.finish_reason) == (
                    w.token_ids, w.loss_mask, w.logprobs, w.finish_reason)  # fmt: skip
                assert len(r.versions) == len(r.token_ids) and set(r.versions) <= {0, it - 1}
        batch = make_batch(gen.prompt_ids, gen.responses, 2, tok.pad_token_id)
        for row, r in enumerate(x for g in gen.responses for x in g):
            assert batch["response_mask"][row, : len(r.token_ids)].tolist() == r.loss_mask
    assert set(asks[i] for i in range(4)) == {0, 1, 2} and [len(g) for g in it2.responses] == [2, 2]
    continued = [r for g in it2.responses for r in g]
    assert all(0 in r.versions and 1 in r.versions for r in continued)  # sampled over both iterations' weights
    assert all(0 in r.loss_mask for r in continued)  # the observations: out of the loss
    m1, m2 = it1.metrics, it2.metrics
    assert m1["agent/turns_mean"] == 1  # the metrics of the episodes that ended: the answers without a call
    # and of the calls made in the iteration's pieces: the longer episodes' first calls in iteration 1 at "turn"
    assert m1["agent/tool_calls"] == (4 if piece == "turn" else 0)
    assert m1["agent/tool_calls"] + m2["agent/tool_calls"] == 2 * (2 + 1) and m2["agent/tool_errors"] == 0
    assert m2["agent/turns_mean"] == 2.5 and m2["agent/length_stops"] == 0
    assert m2["partial_rollout/split_responses"] == 4 and m2["partial_rollout/staleness/max"] == 1


def test_one_step_off_trains_the_agent_loops_episodes_a_version_late_with_their_masks(tok):
    """The agent loop under async_mode one_step_off (the real schedule over the data loader): iteration 2's episodes
    are sampled during iteration 1, with weight version 0, and reach the batch as sampled (tokens, loss mask 0 on the
    observations, logprobs), their agent/* metrics with the batch generated in the call."""
    import torch

    from mindrl.data.prompt_dataset import PromptBatch
    from mindrl.trainer.pipeline.one_step_off import OneStepOff, OneStepOffSchedule
    from mindrl.trainer.pipeline.schedule import Seeds, Sync

    sampling = SamplingConfig(max_tokens=150, n=2)
    asks = [1, 0, 2, 1]
    loader = [PromptBatch([torch.tensor(prompt(tok, f"Use {asks[i]} tools.")) for i in (2 * b, 2 * b + 1)],
                          torch.tensor([2 * b, 2 * b + 1])) for b in range(2)]  # fmt: skip

    def agent():
        return AgentLoop(TurnEngine(tok, calls_script), tok, {"calculator": CalculatorTool({}, CALC_SCHEMA)}, limits())

    sched, straight = OneStepOffSchedule(OneStepOff(1, 2), Sync(loader, agent(), sampling, Seeds(0, 2))), agent()
    first, second = sched.next(1, 0, {}), sched.next(2, 0, {})
    assert first.metrics["agent/tool_calls"] == 2 * (2 + 1)  # iteration 1 sampled iteration 2's batch (asks 2, 1)
    assert second.metrics["async/staleness/max"] == 1 and second.rows_meta["weight_version"] == [0] * 4
    for gen, ask in ((first, asks[:2]), (second, asks[2:])):
        for p, group, k in zip(gen.prompt_ids, gen.responses, ask):
            [want] = straight.run([p], sampling, [0], {})
            for r, w in zip(group, want):
                assert (r.token_ids, r.loss_mask, r.logprobs) == (w.token_ids, w.loss_mask, w.logprobs)
                assert r.versions == [0] * len(r.token_ids)
                assert (0 in r.loss_mask) == (k > 0)  # observations exactly in the episodes that called the tool
        batch = make_batch(gen.prompt_ids, gen.responses, 2, tok.pad_token_id)
        for row, r in enumerate(x for g in gen.responses for x in g):
            assert batch["response_mask"][row, : len(r.token_ids)].tolist() == r.loss_mask
