"""Writes specs/data/kv_membership.jsonl and specs/data/kv_membership_heldout.jsonl, the labelled task of
specs/probes.yaml: is the key-value pair the prompt ends with one of the context's pairs?

Each context ``k1 : v1 , k2 : v2 , ... , km : vm .`` (the embedded model's key-value retrieval format, keys
nouns, values two-digit numbers) is asked about twice: ``kq : vq`` (true) and ``kq : x`` with ``x`` a number
absent from the context (false). The two statements of a context share its id (``context``, the probe's group).
(A harder variant, ``x`` the value of another key of the context, gave the embedded model's heads no held-out
accuracy above 0.57 at the last token: noise for 200 statements.) Run
``python tools/make_kv_membership.py`` from the repository root; it is deterministic.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from headlab.plugins.tasks.generators import KEYS, NUMBERS

ROOT = Path(__file__).resolve().parent.parent


def rows(n_contexts: int, seed: int, first_id: int = 0) -> list[dict]:
    """Two statements (true, false) per context, ``n_contexts`` contexts of 4 to 8 pairs."""
    rng = random.Random(seed)
    out = []
    for c in range(n_contexts):
        m = rng.randint(4, 8)
        keys = rng.sample(KEYS, m)
        values = rng.sample(NUMBERS, m)
        body = " , ".join(f"{k} : {v}" for k, v in zip(keys, values, strict=True))
        q = rng.randrange(m)
        absent = rng.choice([v for v in NUMBERS if v not in values])
        for truth, v in ((True, values[q]), (False, absent)):
            out.append({"text": f"{body} . {keys[q]} : {v}", "truth": truth, "context": first_id + c})
    return out


def main() -> None:
    data = ROOT / "specs" / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, n, seed, first in (("kv_membership", 100, 0, 0), ("kv_membership_heldout", 50, 1, 1000)):
        path = data / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(n, seed, first)))
        print(f"wrote {path.relative_to(ROOT)} ({2 * n} statements)")


if __name__ == "__main__":
    main()
