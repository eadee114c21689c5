"""What a harness run tells a person: terminal summary, JSON, JUnit XML, ownership plot.

`RunReport` takes the per-(implementation, preset, CP group) result dicts that
the ranks all-gathered, decides the verdict and emits it. The terminal gets a
table per preset, group and rank (tokens owned vs expected, duplicates,
misses, wrong slots, KV read back, steps), the corner counts, per-rank time and
memory, the verdict, and the first violation with a one-line command that
reproduces it. The table, JSON and JUnit renderings are in `report_formats`,
the ownership plot in `report_plot`; `Progress` is the bar shown meanwhile.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TextIO

from .checks import Violation
from .report_formats import _Formats


class Progress:
    """A one-line progress bar on stderr (rank 0 only); off unless stderr is a terminal."""

    def __init__(self, total: int, enabled: bool | None = None, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total = max(total, 1)
        self.done = 0
        self._last = 0.0

    def advance(self, n: int, label: str = "") -> None:
        self.done = min(self.total, self.done + n)
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            filled = 30 * self.done // self.total
            self.stream.write(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] "
                f"{self.done}/{self.total} steps {label:<40.40}"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


class RunReport(_Formats):
    """All results of one run: the verdict, and where it goes (`emit`); renderings in `_Formats`."""

    def __init__(
        self, opts, world_size: int, backend: str, results: list[dict], ranks: list[dict]
    ) -> None:
        self.opts = opts
        self.world_size = world_size
        self.backend = backend
        self.results = results
        self.ranks = sorted(ranks, key=lambda r: r["rank"])

    # ------------------------------------------------------------ verdict

    def failures(self, result: dict) -> list[str]:
        out = [Violation(**v).describe() for v in result["violations"][:1]]
        if result["coverage_enforced"] and result["missing_corners"]:
            out.append(
                f"coverage: preset {result['preset']} promised corners it never reached: "
                f"{', '.join(result['missing_corners'])}"
            )
        return out

    def passed(self) -> bool:
        return bool(self.results) and not any(self.failures(r) for r in self.results)

    def violated_checks(self, result: dict) -> list[int]:
        return sorted(int(k) for k in result["violation_counts"])

    def impl_verdicts(self) -> dict[str, dict]:
        """Per implementation: passed, and the checks it violated."""
        out: dict[str, dict] = {}
        for r in self.results:
            v = out.setdefault(
                r["impl"],
                {
                    "passed": True,
                    "violated_checks": set(),
                    "first_violation": None,
                    "unsupported": [],
                },
            )
            v["unsupported"] += [f"{r['preset']}: {w}" for w in r.get("unsupported", [])]
            if self.failures(r):
                v["passed"] = False
            v["violated_checks"].update(self.violated_checks(r))
            if v["first_violation"] is None and r["violations"]:
                v["first_violation"] = Violation(**r["violations"][0]).describe()
        for u in getattr(self.opts, "unsupported", []):
            if u["impl"] in out:
                out[u["impl"]]["unsupported"].append(f"{u['preset']}: {u['what']}")
        for v in out.values():
            v["violated_checks"] = sorted(v["violated_checks"])
            v["unsupported"] = sorted(set(v["unsupported"]))
        return out

    def repro(self, result: dict) -> str:
        parts = [
            os.path.basename(sys.executable),
            "-m",
            "cp_blocktables",
            "verify",
            "--world-size",
            str(result["cp_size"]),
            "--preset",
            result["preset"],
            "--seed",
            str(result["seed"]),
        ]
        if self.opts.cp_size is not None:
            parts += ["--cp-size", str(self.opts.cp_size)]
        if self.opts.steps is not None:
            parts += ["--steps", str(self.opts.steps)]
        if result["impl"] != "cp_blocktables:BlockTables":
            parts += ["--impl", result["impl"]]
        return " ".join(parts)

    # ------------------------------------------------------------ output

    def emit(self, out: TextIO | None = None) -> None:
        out = out or sys.stdout
        out.write("\n".join(self._verdict_lines()) + "\n" if self.opts.quiet else self.render())
        out.flush()
        if self.opts.report_path:
            _write(self.opts.report_path, json.dumps(self.as_dict(), indent=1) + "\n")
        if self.opts.junit_path:
            _write(self.opts.junit_path, self.junit())
        if self.opts.plot_path:
            self.plot(self.opts.plot_path)

    def unsupported_lines(self) -> list[str]:
        """Presets and checks skipped because the implementation lacks what they need."""
        lines = [
            f"  {u['impl']} / {u['preset']}: skipped, {u['what']}"
            for u in getattr(self.opts, "unsupported", [])
        ]
        seen = set()
        for r in self.results:
            for what in r.get("unsupported", []):
                key = (r["impl"], r["preset"], what)
                if key not in seen:
                    seen.add(key)
                    lines.append(f"  {r['impl']} / {r['preset']}: check skipped, {what}")
        if lines:
            lines.insert(0, "not run (not supported by this implementation; not a pass):")
        return lines

    def _verdict_lines(self) -> list[str]:
        bad = [r for r in self.results if self.failures(r)]
        if not bad:
            total = sum(r["tokens_checked"] for r in self.results)
            skipped = self.unsupported_lines()
            scope = " of what the implementation supports" if skipped else ""
            return [
                f"PASS: {len(self.results)} preset runs, {total} tokens, every check{scope} of "
                f"SPEC.md section 6 held at every step",
                *skipped,
            ]
        lines = [f"FAIL: {len(bad)} of {len(self.results)} preset runs broke a check"]
        for r in bad:
            counts = ", ".join(f"check {k}: {n}" for k, n in r["violation_counts"].items())
            lines.append(
                f"  {r['impl']} / {r['preset']} (CP group {r['cp_group']}, seed "
                f"{r['seed']}): {counts or 'coverage'}"
            )
        first = bad[0]
        lines.append("first violation:")
        for text in self.failures(first):
            lines.append(f"  {text}")
        if first["violations"]:
            v = first["violations"][0]
            if v["rank"] is not None:
                lines.append(f"  (cp rank {v['rank']} is global rank {first['ranks'][v['rank']]})")
        lines.append(f"reproduce: {self.repro(first)}")
        return lines


def _write(path: str, text: str) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
