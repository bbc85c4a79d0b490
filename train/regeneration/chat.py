"""The chat template, turn by turn: where a regenerated answer goes in a conversation, where it ends, and the
exact token stream around it (train/regenerate.py's conversations)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from selfspec.train.data.records import DataError
from selfspec.train.loop.config import ConfigError

ANSWER = (
    "\ue000answer {}\ue001"  # stands for the i-th answer while the template renders (private-use characters)
)


def end_of_turn_token(tokenizer) -> int | None:
    """The special token a chat template writes right after an assistant answer (<|im_end|>, <|eot_id|>,
    <eos>): a one-answer conversation is rendered and the first token after the answer kept when it is a
    special token. None without a template, or when no special token follows the answer."""
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ANSWER.format(0)}],
            tokenize=False,
        )
    except jinja2.TemplateError:
        return None
    if text.count(ANSWER.format(0)) != 1:
        return None
    ids = tokenizer(text.split(ANSWER.format(0))[1], add_special_tokens=False)["input_ids"]
    if not ids:
        return None
    added = tokenizer.added_tokens_decoder.get(ids[0])
    return ids[0] if ids[0] in tokenizer.all_special_ids or (added is not None and added.special) else None


def stop_token_ids(tokenizer, generation_eos: int | list[int] | None) -> list[int]:
    """Where an answer ends: the tokenizer's EOS, the generation config's eos_token_id(s) and the template's
    end-of-turn token."""
    extra = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    ids = {tokenizer.eos_token_id, end_of_turn_token(tokenizer), *extra} - {None}
    if not ids:
        raise ConfigError(
            "the tokenizer and the generation config name no end-of-sequence token: an answer could "
            "never end; set eos_token_id in the model's generation_config.json"
        )
    return sorted(ids)


def answer_slots(messages: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """The conversation as the target answers it: its non-assistant turns as they are and None where an answer
    goes. An assistant turn becomes an answer when a user turn came since the previous answer (else it is
    dropped); trailing user turns get one."""
    slots: list[dict[str, Any] | None] = []
    asked = False
    for m in messages:
        if m["role"] != "assistant":
            slots.append(m)
            asked = asked or m["role"] == "user"
        elif asked:
            slots.append(None)
            asked = False
    if asked:
        slots.append(None)
    return slots


@dataclasses.dataclass
class Chat:
    """A conversation being regenerated: its slots, the answers so far, and the exact tokens through the
    last."""

    index: int  # its place among the shard's items
    slots: list[dict[str, Any] | None]
    answers: list[str] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    stopped: bool = (
        False  # whether the last answer ended with a stop token (its end-of-turn is then trained on)
    )
    dropped: int = 0  # answers left out because the conversation outgrew max_length / the model's positions

    def render(self, tokenizer, answered: int, generation_prompt: bool) -> str:
        """The template's text of the slots up to the `answered`-th answer (excluded with a generation prompt,
        included without), each answer a stand-in."""
        ends = [i for i, s in enumerate(self.slots) if s is None]
        stop = ends[answered] if generation_prompt else ends[answered - 1] + 1
        messages, k = [], 0
        for s in self.slots[:stop]:
            messages.append(s if s is not None else {"role": "assistant", "content": ANSWER.format(k)})
            k += s is None
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def next_text(self, tokenizer, generation_prompt: bool = True) -> str:
        """The template text that follows the stream so far: up to the next generation prompt, or
        (without one) the closing text after the last answer."""
        answered = len(self.answers)
        text = self.render(tokenizer, answered, generation_prompt)
        if answered == 0:
            return text
        mark = ANSWER.format(answered - 1)
        if text.count(mark) != 1:
            raise DataError(
                "the chat template does not render earlier assistant turns as they are (it drops or "
                "rewrites them), so answers cannot be regenerated turn by turn; use another template"
            )
        return text.split(mark)[1]

    def follow(self, tokenizer, text: str, stops: set[int]) -> tuple[list[int], list[int]]:
        """The stream extended by template text, and its loss mask: the end-of-turn token right after an
        answer is trained on when the target wrote one."""
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        mask = [0] * len(ids)
        if ids and self.answers and self.stopped and ids[0] in stops:
            mask[0] = 1
        return self.ids + ids, self.mask + mask

    def row(self, tokenizer, stops: set[int]) -> dict[str, Any]:
        """The regenerated conversation: its turns through the last answer, and the exact tokens."""
        ids, mask = self.follow(tokenizer, self.next_text(tokenizer, generation_prompt=False), stops)
        ends = [i for i, s in enumerate(self.slots) if s is None]
        answers = iter(self.answers)
        turns = [
            s if s is not None else {"role": "assistant", "content": next(answers)}
            for s in self.slots[: ends[len(self.answers) - 1] + 1]
        ]
        return {"messages": turns, "input_ids": ids, "loss_mask": mask, "dropped_turns": self.dropped}


def conversation(messages_json: str) -> tuple[list[dict[str, Any] | None] | None, str | None]:
    """A conversation item's answer slots, or why it gives no row."""
    messages = json.loads(messages_json)
    for m in messages:
        if m["content"] is None:
            m["content"] = ""
        if not isinstance(m["content"], str):
            return None, "content that is not text"
    slots = answer_slots(messages)
    return (slots, None) if None in slots else (None, "no user turn")
