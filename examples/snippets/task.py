"""A complete plugin module, a task: docs/plugins.md, "One complete example per kind", shows it, and
tests/test_docs_plugins.py registers it and checks what it computes."""

# --8<-- [start:example]
import random
from typing import Literal

from pydantic import Field

from headlab.plugin import ComponentConfig, Example, TaskContext, hookimpl


class CopyFirst(ComponentConfig):
    """Random token sequences followed by their first token again."""

    kind: Literal["copy_first"] = "copy_first"
    n: int = Field(8, ge=1, description="number of examples")
    length: int = Field(10, ge=2, description="random tokens per example")


def build(config: CopyFirst, ctx: TaskContext) -> list[Example]:
    rng = random.Random(ctx.seed)
    examples = []
    for _ in range(config.n):
        ids = [rng.randrange(4, ctx.vocab_size) for _ in range(config.length)]
        examples.append(Example(prompt="", input_ids=ids + [ids[0]], meta={"first": ids[0]}))
    return examples


@hookimpl
def headlab_register_tasks(register):
    register(CopyFirst, build)
# --8<-- [end:example]
