"""Turn every rank's outcome of one test into one pytest verdict and one readable report.

The verdict is "passed", "skipped" or "xfailed" only when every rank ended that way;
anything else (a failure, a dead or hung rank, a skip on some ranks only) is a failure
whose report lists every rank's status, then each failing rank's traceback and each
killed rank's stack, then a one-line reproduction command.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .protocol import Outcome

RANK_TABLE = pytest.StashKey[str]()
"""Per-rank status table attached to a test item whose own traceback pytest prints."""

_BAD = ("failed", "died", "timeout", "stopped")


@dataclass(frozen=True)
class Verdict:
    """The test's single outcome; for a failure, `headline` is the short summary line."""

    status: str
    headline: str


class RanksLongrepr(str):
    """A failure report that pytest prints as is, with a `reprcrash` for summary lines.

    Being a `str`, it survives pytest-xdist's report serialisation unchanged.
    """

    def __new__(cls, text: str, headline: str) -> RanksLongrepr:
        obj = super().__new__(cls, text)
        obj.reprcrash = _Crash(headline)
        return obj

    def toterminal(self, tw) -> None:
        for line in str(self).splitlines():
            tw.line(line, red=line.startswith("E "))


class RanksFailed(Exception):
    """Raised in the pytest process when the ranks did not all end the same quiet way."""

    def __init__(self, longrepr: RanksLongrepr) -> None:
        super().__init__(longrepr.reprcrash.message)
        self.longrepr = longrepr


@dataclass(frozen=True)
class _Crash:
    message: str
    path: str = ""
    lineno: int = 0


def verdict(outcomes: list[Outcome], timeout_s: float) -> Verdict:
    """One verdict for the test from the per-rank outcomes (ordered by rank).

    The headline names a dead rank before a failed one: when a rank dies, its peers
    usually fail too, with connection errors that only echo the death.
    """
    by_status: dict[str, list[int]] = {}
    for o in outcomes:
        by_status.setdefault(o.status, []).append(o.rank)
    if len(by_status) == 1 and outcomes[0].status in ("passed", "skipped", "xfailed"):
        reasons = sorted({o.message for o in outcomes})
        return Verdict(outcomes[0].status, "; ".join(reasons))
    if "timeout" in by_status:
        return Verdict("failed", f"timed out after {timeout_s:g} s on ranks {by_status['timeout']}")
    dead = [o for o in outcomes if o.status == "died"]
    first_bad = (dead or [o for o in outcomes if o.status == "failed"] or [None])[0]
    if first_bad is not None:
        bad = sorted(by_status.get("failed", []) + by_status.get("died", []))
        first = f"rank {first_bad.rank}: {_clip(first_bad.message)}"
        return Verdict("failed", f"failed on ranks {bad}; {first}")
    for quiet in ("skipped", "xfailed"):
        if quiet in by_status:
            others = sorted(r for s, rs in by_status.items() if s != quiet for r in rs)
            call = "pytest.skip()" if quiet == "skipped" else "pytest.xfail()"
            return Verdict(
                "failed",
                f"{call} on ranks {by_status[quiet]} only; ranks {others} ran the test: "
                f"skip on every rank or on none",
            )
    return Verdict("failed", f"ranks ended unevenly: {by_status}")


def render(
    outcomes: list[Outcome],
    stacks: dict[int, str],
    headline: str,
    context: str,
    repro: str,
) -> RanksLongrepr:
    """The failure report: status table, tracebacks, stacks, reproduction line."""
    lines = [f"{len(outcomes)}-rank test: {headline}", f"  ({context})", status_table(outcomes)]
    for o in outcomes:
        if o.status == "failed" and o.longrepr:
            lines += [_rule(f"rank {o.rank} traceback"), o.longrepr.rstrip()]
    for o in outcomes:
        stack = stacks.get(o.rank) or o.extra.get("stack", "")
        if stack.strip():
            lines += [_rule(f"rank {o.rank} Python stacks ({o.status})"), stack.rstrip()]
    lines += ["", repro]
    return RanksLongrepr("\n".join(lines), headline)


def status_table(outcomes: list[Outcome]) -> str:
    """One line per rank: its status, how long it ran and its short message."""
    return "\n".join(_status_line(o) for o in outcomes)


def _status_line(o: Outcome) -> str:
    label = {
        "timeout": "TIMEOUT still running at the deadline; stacks dumped, killed",
        "stopped": "STOPPED still running after another rank failed; stacks dumped, killed",
    }.get(o.status, o.status.upper() if o.status in _BAD else o.status)
    detail = f" {_clip(o.message)}" if o.message else ""
    took = f" ({o.duration_s:.2f} s)" if o.status not in ("timeout", "stopped", "died") else ""
    return f"  rank {o.rank}: {label}{took}{detail}"


def _clip(message: str, limit: int = 160) -> str:
    first = message.splitlines()[0] if message else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."


def _rule(title: str, width: int = 78) -> str:
    pad = max(2, width - len(title) - 2)
    return f"{'_' * (pad // 2)} {title} {'_' * (pad - pad // 2)}"
