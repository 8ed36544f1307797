"""Handlers turn raw dataset rows into token documents (input_ids, attention_mask, labels, extra keys); selected by
`handler_name`, each says which row fields it reads (`map_keys`) and what `labels` means."""

from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mindrl.data.templates import ChatTemplate, fill_slot

IGNORE_INDEX = -100  # label value that the SFT loss skips (prompt positions)
MAP_KEY_NAMES = ("prompt", "query", "response", "system", "chosen", "rejected", "margin")  # of all handlers
# Every token document is stored as int32: signed (labels hold IGNORE_INDEX) and wide enough for any vocabulary.
TOKEN_DTYPE = np.int32


class BadRow(Exception):
    """A row that cannot become a document; the message is the reason shown in the report."""


@dataclass
class EncodedChunk:
    """A chunk of rows after tokenisation, in input order, kept flat so it pickles cheaply between processes.

    flat[key] holds the tokens of the good rows back to back; lengths[key][j] is the j-th good row's length.
    bad lists (position in chunk, reason) for the skipped rows.
    """

    flat: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    good: list[int]
    bad: list[tuple[int, str]]


class Handler:
    """Base: read the mapped fields, render the prompt with the template, tokenise a chunk in one batch call."""

    name: ClassVar[str] = ""
    default_map_keys: ClassVar[dict[str, str]] = {}
    # Keys this handler writes itself; dataset_additional_keys beyond these are raw row columns, tokenised.
    produces: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask", "labels")
    # The roles this handler reads (map_keys' keys), and those the row must map.
    roles: ClassVar[tuple[str, ...]] = ("prompt", "query", "response", "system")
    required_roles: ClassVar[tuple[str, ...]] = ("prompt", "response")
    # Written keys that are not token ids (their own dtype in the indexed dataset).
    key_dtypes: ClassVar[dict[str, type[np.number]]] = {}

    @classmethod
    def dtype_of(cls, key: str) -> type[np.number]:
        return cls.key_dtypes.get(key, TOKEN_DTYPE)

    def __init__(
        self,
        tokenizer: Any,
        template: ChatTemplate,
        map_keys: dict[str, str] | None = None,
        additional_keys: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        # Given map_keys replace the defaults as a whole: a role left out is unused, not silently defaulted
        # to a field name the data may not have.
        self.map_keys = {r: "" for r in self.roles} | dict(map_keys or self.default_map_keys)
        for role in self.required_roles:
            if not self.map_keys[role]:
                raise ValueError(f"{self.name} needs map_keys['{role}'] (the row field holding the {role})")
        self.extra_keys = [k for k in additional_keys if k not in self.produces]
        self.bos = tokenizer.bos_token or ""
        self.eos = tokenizer.eos_token or ""

    # --- row -> texts -----------------------------------------------------------------------------
    def field(self, row: dict[str, Any], role: str, required: bool = True) -> str:
        """The string under map_keys[role]; '' when the role is not mapped. Raises BadRow on bad values."""
        key = self.map_keys.get(role, "")
        if not key:
            return ""
        if key not in row:
            raise BadRow(f"missing key '{key}' ({role})")
        value = row[key]
        if value is None:
            raise BadRow(f"null value for key '{key}' ({role})")
        if not isinstance(value, str):
            raise BadRow(f"non-string value for key '{key}' ({role}): {type(value).__name__}")
        if required and not value.strip():
            raise BadRow(f"empty {role} (key '{key}')")
        return value

    def prompt_text(self, row: dict[str, Any]) -> str:
        prompt = self.field(row, "prompt")
        query = self.field(row, "query", required=False)
        # Alpaca convention: the optional input ("query") follows the instruction on its own line.
        content = f"{prompt}\n{query}" if query else prompt
        system = self.field(row, "system", required=False)
        # A reasoning template (Qwen3) ends the prompt with an empty thought unless the response brings its own.
        response = self.field(row, "response", required=False) if self.template.thought_words else ""
        return self.template.render_prompt(content, system, self.bos, self.eos, response)

    def response_text(self, row: dict[str, Any]) -> str:
        raise NotImplementedError

    def response_texts(self, row: dict[str, Any]) -> tuple[str, ...]:
        """The responses that follow the prompt (one; a pairwise handler returns chosen and rejected)."""
        return (self.response_text(row),)

    def row_values(self, row: dict[str, Any]) -> dict[str, list[float]]:
        """Non-token values of the row (key -> its document), beside the token documents."""
        return {}

    # Whether response text may contain special tokens (a rendered assistant turn) or must not (an answer).
    response_is_template: ClassVar[bool] = False

    def assemble(self, prompt_ids: list[int], *response_ids: list[int], labels=None) -> dict[str, list[int]]:
        """The documents of a row; `labels`: `response_labels` of each response."""
        raise NotImplementedError

    def response_labels(self, texts: list[str], ids: list[list[int]]) -> list[list[int]]:
        """The labels of responses `texts` tokenised as `ids` (a chunk's): the ids themselves, trained on whole."""
        return ids

    # --- chunk -> tokens -------------------------------------------------------------------------
    def encode_chunk(self, rows: list[Any]) -> EncodedChunk:
        prompts, responses, values, extras, good, bad = [], [], [], [], [], []
        for i, row in enumerate(rows):
            try:
                if not isinstance(row, dict):
                    raise BadRow(f"row is not an object but {type(row).__name__}")
                p, r, v = self.prompt_text(row), self.response_texts(row), self.row_values(row)
                ex = [self._extra_field(row, k) for k in self.extra_keys]
            except BadRow as e:
                bad.append((i, str(e)))
                continue
            prompts.append(p)
            responses.append(r)
            values.append(v)
            extras.append(ex)
            good.append(i)
        out: dict[str, list[list[int]]] = {k: [] for k in (*self.produces, *self.extra_keys)}
        if good:
            # Special tokens written in the template ("<|im_start|>") must become their single ids, but an
            # answer is plain text: split_special_tokens keeps a literal "<|im_end|>" in it from turning special.
            p_ids = self._tokenize(prompts, split_special=False)
            r_ids = [
                self._tokenize(list(texts), split_special=not self.response_is_template) for texts in zip(*responses)
            ]
            r_labels = [self.response_labels(list(texts), ids) for texts, ids in zip(zip(*responses), r_ids)]
            for pi, vals, ri, rl in zip(p_ids, values, zip(*r_ids), zip(*r_labels)):
                for k, v in (self.assemble(pi, *ri, labels=rl) | vals).items():
                    out[k].append(v)
            for j, k in enumerate(self.extra_keys):
                out[k] = self._tokenize([ex[j] for ex in extras], split_special=True)
        lengths = {k: np.array([len(seq) for seq in v], dtype=np.int64) for k, v in out.items()}
        flat = {
            k: np.fromiter(itertools.chain.from_iterable(v), dtype=self.dtype_of(k), count=int(lengths[k].sum()))
            for k, v in out.items()
        }
        return EncodedChunk(flat=flat, lengths=lengths, good=good, bad=bad)

    def _extra_field(self, row: dict[str, Any], key: str) -> str:
        if key not in row:
            raise BadRow(f"missing key '{key}' (dataset_additional_keys)")
        if row[key] is None:
            raise BadRow(f"null value for key '{key}' (dataset_additional_keys)")
        if not isinstance(row[key], str):
            raise BadRow(f"non-string value for key '{key}' (dataset_additional_keys): {type(row[key]).__name__}")
        return row[key]

    def _tokenize(self, texts: list[str], split_special: bool) -> list[list[int]]:
        return self.tokenizer(
            texts, add_special_tokens=False, split_special_tokens=split_special, return_attention_mask=False
        )["input_ids"]


class R1AlpacaStyleInstructionHandler(Handler):
    """RL prompts: input_ids = the templated prompt only; labels = the tokenised reference answer."""

    name = "R1AlpacaStyleInstructionHandler"
    default_map_keys = {"prompt": "instruction", "query": "input", "response": "output", "system": ""}

    def response_text(self, row: dict[str, Any]) -> str:
        return self.field(row, "response").strip()

    def assemble(self, prompt_ids: list[int], response_ids: list[int], labels=None) -> dict[str, list[int]]:
        return {"input_ids": prompt_ids, "attention_mask": [1] * len(prompt_ids), "labels": response_ids}


class GSM8KStyleInstructionHandler(R1AlpacaStyleInstructionHandler):
    """RL prompts from GSM8K-style rows: the reference answer is what follows '####' in the solution."""

    name = "GSM8KStyleInstructionHandler"
    default_map_keys = {"prompt": "question", "query": "", "response": "answer", "system": ""}

    def response_text(self, row: dict[str, Any]) -> str:
        solution = self.field(row, "response")
        if "####" not in solution:
            raise BadRow(f"no '####' answer marker in key '{self.map_keys['response']}'")
        # GSM8K writes thousands separators ("1,000"); verifiers compare the bare number.
        answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
        if not answer:
            raise BadRow(f"empty answer after '####' in key '{self.map_keys['response']}'")
        return answer


class AlpacaStyleInstructionHandler(Handler):
    """SFT pairs: input_ids = prompt + templated response; labels = IGNORE_INDEX over the prompt, then the response.
    A response that holds a multi-turn trace (an agent's tool calls, each answered by a `<tool_response>` turn) is
    trained only on what the model writes: the turns in it rendered in the template's user slot (from the slot's
    opening through its end, which opens the next assistant turn) are context, labelled IGNORE_INDEX, as the agent
    loop's observations are out of the RL loss."""

    name = "AlpacaStyleInstructionHandler"
    default_map_keys = {"prompt": "instruction", "query": "input", "response": "output", "system": ""}
    response_is_template = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        head, _, tail = fill_slot(self.template.user, "\0", self.bos, self.eos).partition("\0")
        # A template whose user slot is bare content cannot tell a user turn from the model's own text.
        self._user_turn = re.compile(re.escape(head) + ".*?" + re.escape(tail), re.DOTALL) if head and tail else None

    def response_text(self, row: dict[str, Any]) -> str:
        return self.template.render_response(self.field(row, "response"), self.bos, self.eos)

    def response_labels(self, texts: list[str], ids: list[list[int]]) -> list[list[int]]:
        spans = [[m.span() for m in self._user_turn.finditer(t)] if self._user_turn else [] for t in texts]
        held = [i for i, s in enumerate(spans) if s]
        if not held:
            return ids
        offsets = self.tokenizer(
            [texts[i] for i in held], add_special_tokens=False, split_special_tokens=not self.response_is_template,
            return_offsets_mapping=True,
        )  # fmt: skip
        labels = list(ids)
        for i, toks, where in zip(held, offsets["input_ids"], offsets["offset_mapping"]):
            if toks != ids[i]:
                raise RuntimeError(f"{self.name}: the tokenizer's offsets call gave other ids than its plain call")
            # a token wholly inside a user turn is context; one that straddles its edge holds the model's text too
            labels[i] = [IGNORE_INDEX if any(a <= s and e <= b for a, b in spans[i]) else t
                         for t, (s, e) in zip(ids[i], where)]  # fmt: skip
        return labels

    def assemble(self, prompt_ids: list[int], response_ids: list[int], labels=None) -> dict[str, list[int]]:
        ids = prompt_ids + response_ids
        return {
            "input_ids": ids,
            "attention_mask": [1] * len(ids),
            "labels": [IGNORE_INDEX] * len(prompt_ids) + list(labels[0] if labels else response_ids),
        }


class AlpacaStylePairwiseHandler(Handler):
    """Preference pairs (reward model, DPO): one prompt, a chosen and a rejected response, each written as
    prompt + templated response with labels = IGNORE_INDEX over the prompt (MindSpeed's pairwise keys); `margin`
    holds the row's Bradley-Terry margin (float32, 0 when map_keys has no 'margin'). A pair whose two responses
    are the same text carries no preference and is a bad row."""

    name = "AlpacaStylePairwiseHandler"
    default_map_keys = {"prompt": "prompt", "query": "", "chosen": "chosen", "rejected": "rejected", "system": ""}
    produces = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "margin")
    roles = ("prompt", "query", "system", "chosen", "rejected", "margin")
    required_roles = ("prompt", "chosen", "rejected")
    key_dtypes = {"margin": np.float32}
    response_is_template = True

    def response_texts(self, row: dict[str, Any]) -> tuple[str, ...]:
        chosen, rejected = self.field(row, "chosen"), self.field(row, "rejected")
        if chosen == rejected:
            raise BadRow(
                f"chosen and rejected are the same text (keys '{self.map_keys['chosen']}', "
                f"'{self.map_keys['rejected']}'): the pair carries no preference"
            )
        return tuple(
            self._end_at_stop(self.template.render_response(r, self.bos, self.eos)) for r in (chosen, rejected)
        )

    def _end_at_stop(self, text: str) -> str:
        """The response up to its end-of-turn stop word, without the template's separator after it: a reward model
        scores the last token, and in the RL loop that is the stop word the policy's generation ends with."""
        for word in self.template.stop_words:
            i = text.rfind(word)
            if i >= 0 and not text[i + len(word) :].strip():
                return text[: i + len(word)]
        return text

    def row_values(self, row: dict[str, Any]) -> dict[str, list[float]]:
        key = self.map_keys.get("margin", "")
        if not key:
            return {"margin": [0.0]}
        if key not in row:
            raise BadRow(f"missing key '{key}' (margin)")
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
            raise BadRow(f"margin (key '{key}') must be a finite number, got {value!r}")
        return {"margin": [float(value)]}

    def assemble(self, prompt_ids: list[int], *response_ids: list[int], labels=None) -> dict[str, list[int]]:
        chosen_ids, rejected_ids = response_ids
        prompt_labels = [IGNORE_INDEX] * len(prompt_ids)
        return {
            "chosen_input_ids": prompt_ids + chosen_ids,
            "chosen_labels": prompt_labels + chosen_ids,
            "rejected_input_ids": prompt_ids + rejected_ids,
            "rejected_labels": prompt_labels + rejected_ids,
        }


HANDLERS: dict[str, type[Handler]] = {
    h.name: h
    for h in (
        R1AlpacaStyleInstructionHandler,
        AlpacaStyleInstructionHandler,
        GSM8KStyleInstructionHandler,
        AlpacaStylePairwiseHandler,
    )
}


def get_handler_class(name: str) -> type[Handler]:
    """The handler called `name`; an unknown name lists the known ones and the close matches."""
    if name not in HANDLERS:
        close = difflib.get_close_matches(name, HANDLERS, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"unknown handler_name '{name}'.{hint} Known: {', '.join(sorted(HANDLERS))}")
    return HANDLERS[name]
