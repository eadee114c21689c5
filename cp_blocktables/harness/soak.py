"""`cp-blocktables soak`: the harness round after round, with fresh seeds, until a budget
(minutes, steps or tokens verified) is spent or a check breaks.

Each rank runs `runner.run_rank` once per round, with the round's seeds
(round `r` uses `seed + r * world_size`, so no CP group of any round repeats
another's). Rank 0 reads the round's JSON report, prints a progress line
(rounds, tokens verified, rate per rank, budget left) and decides whether
another round fits the budget; it writes the decision into the job's
rendezvous store and the other ranks wait for it there (a rank 0 that never
decides is named within the timeout). A round that breaks a check ends every
rank (`run_rank` returns the same verdict on all of them): rank 0 prints the
round's report and the one-line command that reproduces the violation with
the seed that found it, and the soak exits 1. A clean soak exits 0 with the
totals and each rank's peak RSS after the first round and at the end, which
shows whether memory stays flat across rounds.

Needs the job's store to outlive the rounds: torchrun's agent store
(`TORCHELASTIC_USE_AGENT_STORE=True`, torchrun's default) or a local spawn.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta

from .group import PeerError, RankEnv
from .options import VerifyOptions
from .runner import run_rank

_DECISION = "cpbt/soak/"


@dataclass
class SoakOptions:
    """What to soak, for how long, and where; identical on every rank."""

    rounds: VerifyOptions  # the template of each round (its seed is the first round's)
    seconds: float | None = None
    steps: int | None = None
    tokens: int | None = None
    report_path: str | None = None
    junit_path: str | None = None

    def round_options(self, r: int, report_path: str | None, junit_path: str | None):
        return replace(
            self.rounds,
            seed=self.rounds.seed + r * self.rounds.world_size,
            report_path=report_path,
            junit_path=junit_path,
            plot_path=None,
            progress=False,
            fail_fast=True,
            keep_going=False,
            skipped=[],
        )

    def budget(self) -> str:
        parts = []
        if self.seconds is not None:
            parts.append(f"{self.seconds:g} s")
        if self.steps is not None:
            parts.append(f"{self.steps} steps")
        if self.tokens is not None:
            parts.append(f"{self.tokens} tokens")
        return ", ".join(parts)


@dataclass
class _Tally:
    """Rank 0's running totals over rounds."""

    rounds: int = 0
    tokens: int = 0
    steps: int = 0
    preset_runs: int = 0
    round_s: list[float] = field(default_factory=list)
    ranks: dict[int, dict] = field(default_factory=dict)

    def add(self, data: dict, wall: float) -> None:
        self.rounds += 1
        self.round_s.append(wall)
        results = data.get("results", [])
        self.tokens += sum(r["tokens_checked"] for r in results)
        self.steps += sum(r["steps_checked"] for r in results)
        self.preset_runs += len(results)
        for i in data.get("ranks", []):
            t = self.ranks.setdefault(
                i["rank"], {"tokens": 0, "busy_s": 0.0, "rss_first_round_mb": i["max_rss_mb"]}
            )
            t["tokens"] += i["tokens"]
            t["busy_s"] += i["wall_s"]
            t["peak_rss_mb"] = i["max_rss_mb"]
            t["backend"], t["device"] = i.get("backend"), i.get("device")

    def rate(self, rank: int) -> float:
        t = self.ranks.get(rank)
        return t["tokens"] / t["busy_s"] if t and t["busy_s"] else 0.0

    def as_dict(self, opts: SoakOptions, wall: float, passed: bool) -> dict:
        return {
            "passed": passed,
            "budget": {"seconds": opts.seconds, "steps": opts.steps, "tokens": opts.tokens},
            "rounds": self.rounds,
            "first_seed": opts.rounds.seed,
            "wall_s": round(wall, 3),
            "preset_runs": self.preset_runs,
            "steps": self.steps,
            "tokens": self.tokens,
            "round_s": [round(s, 3) for s in self.round_s],
            "ranks": [
                dict(t, rank=r, tokens_per_s=round(self.rate(r), 1))
                for r, t in sorted(self.ranks.items())
            ],
        }


def soak_rank(opts: SoakOptions) -> int:
    """One rank's soak: rounds of `run_rank` until rank 0 says the budget is spent."""
    env = RankEnv.from_environ()
    if env is None:
        print("cp-blocktables: no torchrun environment (RANK, WORLD_SIZE)", file=sys.stderr)
        return 2
    try:
        store = _decision_store(env, opts.rounds.timeout)
    except (RuntimeError, ValueError) as e:
        print(f"cp-blocktables: rank {env.rank}: soak: no rendezvous store: {e}", file=sys.stderr)
        return 1
    if env.rank == 0:
        return _Leader(opts, store).run()
    return _follow(opts, store, env.rank)


def _decision_store(env: RankEnv, timeout: float):
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )
    return dist.PrefixStore(f"{_DECISION}attempt{attempt}/", store)


def _follow(opts: SoakOptions, store, rank: int) -> int:
    for r in range(sys.maxsize):
        code = run_rank(opts.round_options(r, None, None))
        gc.collect()
        if code != 0:
            return code
        key = f"round{r}"
        try:
            store.wait([key], timedelta(seconds=opts.rounds.timeout))
        except Exception:  # noqa: BLE001 - a timeout, or the store gone with rank 0's host
            e = PeerError(
                f"rank {rank}: soak: no decision from rank 0 within "
                f"{opts.rounds.timeout:.0f} s of the end of round {r + 1}"
            )
            print(f"cp-blocktables: {e}", file=sys.stderr, flush=True)
            return 1
        if store.get(key).decode() != "go":
            return 0
    return 0


class _Leader:
    """Rank 0: runs the rounds like every rank, and reads, prints and decides."""

    def __init__(self, opts: SoakOptions, store) -> None:
        self.opts = opts
        self.store = store
        self.tally = _Tally()
        self.t0 = time.monotonic()
        self.tmp = tempfile.mkdtemp(prefix="cp-blocktables-soak-")
        self.last: dict = {}

    def run(self) -> int:
        try:
            return self._rounds()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _rounds(self) -> int:
        for r in range(sys.maxsize):
            report = os.path.join(self.tmp, "round.json")
            junit = os.path.join(self.tmp, "round.xml")
            for path in (report, junit):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            ropts = self.opts.round_options(r, report, junit)
            started = time.monotonic()
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = run_rank(ropts)
            gc.collect()
            wall = time.monotonic() - started
            self.last = _read(report)
            if r == 0:  # notes of the group's formation, e.g. ranks sharing GPUs
                for line in out.getvalue().splitlines():
                    if line.startswith("cp-blocktables:"):
                        print(line, flush=True)
            if self.last:
                self.tally.add(self.last, wall)
            self._progress(r, ropts.seed)
            if code != 0:
                return self._failed(r, code, out.getvalue(), junit)
            go = self._another_round_fits()
            self.store.set(f"round{r}", "go" if go else "stop")
            if not go:
                return self._passed(junit)
        return 0

    def _another_round_fits(self) -> bool:
        o, t = self.opts, self.tally
        if o.steps is not None and t.steps >= o.steps:
            return False
        if o.tokens is not None and t.tokens >= o.tokens:
            return False
        if o.seconds is not None:
            mean = sum(t.round_s) / len(t.round_s) if t.round_s else 0.0
            return time.monotonic() - self.t0 + mean <= o.seconds
        return True

    def _progress(self, r: int, seed: int) -> None:
        t, elapsed = self.tally, time.monotonic() - self.t0
        rates = [t.rate(k) for k in sorted(t.ranks)]
        rate = f"{min(rates):,.0f}-{max(rates):,.0f}" if rates else "?"
        print(
            f"soak: round {r + 1} (seeds from {seed}): {t.tokens:,} tokens verified in "
            f"{_n(t.rounds, 'round')}, {t.steps:,} steps, {elapsed:.0f} s of "
            f"{self.opts.budget()}, {rate} tokens/s a rank",
            file=sys.stderr,
            flush=True,
        )

    def _failed(self, r: int, code: int, printed: str, junit: str) -> int:
        sys.stdout.write(printed)
        repro = next((x["repro"] for x in self.last.get("results", []) if x.get("failures")), None)
        where = f"round {r + 1} (seeds from {self.opts.round_options(r, None, None).seed})"
        if repro:
            print(f"soak: FAIL in {where} after {self.tally.tokens:,} tokens; reproduce: {repro}")
        else:
            print(f"soak: FAIL in {where} (exit code {code}); see the messages above")
        self._write(False, junit)
        sys.stdout.flush()
        return code

    def _passed(self, junit: str) -> int:
        t, wall = self.tally, time.monotonic() - self.t0
        lines = [
            f"soak: PASS: {_n(t.rounds, 'round')}, {_n(t.preset_runs, 'preset run')}, "
            f"{t.steps:,} steps, "
            f"{t.tokens:,} tokens verified in {wall:.1f} s; every check held",
            "per rank: "
            + "; ".join(
                f"rank {k} ({v.get('backend')}, {v.get('device')}): {t.rate(k):,.0f} tokens/s, "
                f"peak RSS {v['rss_first_round_mb']:.0f} MB after round 1, "
                f"{v['peak_rss_mb']:.0f} MB at the end"
                for k, v in sorted(t.ranks.items())
            ),
        ]
        print("\n".join(lines) if not self.opts.rounds.quiet else lines[0], flush=True)
        self._write(True, junit)
        return 0

    def _write(self, passed: bool, junit: str) -> None:
        wall = time.monotonic() - self.t0
        if self.opts.report_path:
            data = self.tally.as_dict(self.opts, wall, passed)
            data["last_round"] = self.last
            _write_text(self.opts.report_path, json.dumps(data, indent=1) + "\n")
        if self.opts.junit_path and os.path.exists(junit):
            with open(junit) as f:
                _write_text(self.opts.junit_path, f.read())


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_text(path: str, text: str) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
