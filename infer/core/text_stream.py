"""Token ids as text while they arrive: `SpeculativeModel.stream`'s pieces, each the text its step adds."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


def text_pieces(steps: Iterable[list[int]], tokenizer: Any) -> Iterator[str]:
    """Each step's new ids (`steps`, as `decode` yields them) as the text they add when decoded after a few
    earlier ids (so tokenizers that drop a leading space at the start still join right); a piece ending
    mid-character waits for the next step, and what is held back at the end comes last."""
    ids: list[int] = []
    prefix, read = 0, 0  # ids[prefix:read] is context already printed; ids[read:] is not printed yet
    for step in steps:
        ids.extend(step)
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        after = tokenizer.decode(ids[prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            yield after[len(before) :]
            prefix, read = read, len(ids)
    if read < len(ids):  # whatever was held back at the end
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        after = tokenizer.decode(ids[prefix:], skip_special_tokens=True)
        if len(after) > len(before):
            yield after[len(before) :]
