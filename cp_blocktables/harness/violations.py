"""Violations of SPEC.md section 6's checks, and check 7 (agreement across ranks)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from ..contract import PAD_SLOT_ID

CHECKS = {
    0: "implementation raised an error",
    1: "sharded group: exactly one rank, the owner, writes each token at section 2's slot",
    2: "unsharded group or cp_size 1: every rank writes section 2's slot",
    3: "PAD_SLOT_ID for disabled groups, dummy tokens and the padded tail",
    4: "no two tokens share a slot; each slot lies in a block of the token's own request",
    5: "KV round trip: every position read back once, on its owner, no foreign token",
    6: "gathered block tables: copied rows, zero dummy/padding/stale rows, window masking",
    7: "configs, workload and block tables agree across ranks",
    8: "an append past a row's capacity raises RuntimeError and changes nothing",
    9: "construction refuses an invalid config naming the argument; builds valid huge blocks",
    10: "integrity checks (SPEC.md 8.3) raise RuntimeError: shared slot, stale count, wrong row",
    11: "after a sleep or a reallocation, the rebuild leaves nothing stale; reads as before (8.4)",
}

_TAG_SHIFT = 40
_PER_STEP_REPORTS = 4
"""Violations recorded per check, group and step: enough to see the pattern, not a flood."""

STAT_FIELDS = (
    "owned",
    "expected",
    "duplicates",
    "misses",
    "wrong_slots",
    "read_back",
    "read_expected",
)


@dataclass
class Violation:
    """One broken expectation, with everything needed to find it again."""

    check: int
    what: str
    step: int
    group: int | None = None
    request: int | None = None
    row: int | None = None
    position: int | None = None
    token: int | None = None
    rank: int | None = None
    expected: str = ""
    actual: str = ""

    def describe(self) -> str:
        where = [f"step {self.step}"]
        for name in ("group", "request", "row", "position", "token", "rank"):
            value = getattr(self, name)
            if value is not None:
                where.append(f"{name} {value}")
        text = f"check {self.check} ({CHECKS[self.check]}): {self.what} [{', '.join(where)}]"
        if self.expected or self.actual:
            text += f"; expected {self.expected}, actual {self.actual}"
        return text

    def as_dict(self) -> dict:
        return asdict(self)


def _tag(uid: int, position: int) -> int:
    return (uid << _TAG_SHIFT) | position


def _untag(tag: int | None) -> str:
    if tag is None:
        return "nothing written"
    return f"request {tag >> _TAG_SHIFT} position {tag & ((1 << _TAG_SHIFT) - 1)}"


def _slot(value: int) -> str:
    return "PAD_SLOT_ID" if value == PAD_SLOT_ID else f"slot {value}"


def agreement_violations(
    entries: list[dict], what: str, step: int, ranks: list[int] | None = None
) -> list[Violation]:
    """Check 7: every field of `entries` (one dict per rank) must agree with the majority."""
    ranks = ranks if ranks is not None else list(range(len(entries)))
    out = []
    fields = sorted({k for e in entries for k in e})
    for name in fields:
        values = [repr(e.get(name, "<missing>")) for e in entries]
        if len(set(values)) == 1:
            continue
        majority, _ = Counter(values).most_common(1)[0]
        for rank, v in zip(ranks, values, strict=True):
            if v != majority:
                out.append(
                    Violation(
                        7,
                        f"{what}: field {name!r} differs between ranks ("
                        + ", ".join(f"rank {r}: {x}" for r, x in zip(ranks, values, strict=True))
                        + ")",
                        step,
                        rank=rank,
                        expected=majority,
                        actual=v,
                    )
                )
    return out
