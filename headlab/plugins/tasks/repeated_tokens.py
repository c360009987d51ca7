"""``repeated_tokens``: random token sequences repeated twice, the classic induction-head probe.

Example ``i`` is ``[bos] + s + s`` with ``s`` drawn uniformly (seeded) from the vocabulary, special
tokens excluded. With several ``lengths`` the examples cycle through them, so a detector cannot
succeed through a fixed positional offset.
"""

from __future__ import annotations

import random
from typing import Annotated, Literal

from pydantic import Field

from headlab.plugin import ComponentConfig, Example, PositiveInt, TaskContext, hookimpl
from headlab.resources import TaskSize


class RepeatedTokens(ComponentConfig):
    """Random tokens repeated twice (induction / duplicate-token probe)."""

    kind: Literal["repeated_tokens"] = "repeated_tokens"
    n: PositiveInt = Field(8, description="number of sequences")
    length: PositiveInt | Annotated[list[PositiveInt], Field(min_length=1)] = Field(24, description="length of the random segment (or several, cycled)")
    bos: bool = Field(True, description="prepend the tokenizer's BOS token when it has one")

    def example_fields(self) -> frozenset[str]:
        """Token ids, and the segment's length in meta (for ``requires()`` checks)."""
        return frozenset({"input_ids", "meta.segment_length"})

    def size(self) -> TaskSize:
        """``n`` examples of at most ``1 + 2 x length`` tokens (for the resource guard)."""
        lengths = self.length if isinstance(self.length, list) else [self.length]
        return TaskSize(self.n, 1 + 2 * max(lengths))


def build(config: RepeatedTokens, ctx: TaskContext) -> list[Example]:
    """Build ``n`` examples ``[bos] + s + s``."""
    rng = random.Random(ctx.seed)
    tok = ctx.tokenizer
    special = set(getattr(tok, "all_special_ids", []) or [])
    vocab = [i for i in range(ctx.vocab_size) if i not in special]
    lengths = config.length if isinstance(config.length, list) else [config.length]
    bos = getattr(tok, "bos_token_id", None) if (config.bos and tok is not None) else None
    examples = []
    for i in range(config.n):
        length = lengths[i % len(lengths)]
        seg = [rng.choice(vocab) for _ in range(length)]
        ids = ([bos] if bos is not None else []) + seg + seg
        prompt = tok.decode(ids) if tok is not None else " ".join(map(str, ids))
        examples.append(Example(prompt=prompt, input_ids=ids, meta={"segment_length": length}))
    return examples


@hookimpl
def headlab_register_tasks(register):
    register(RepeatedTokens, build)
