"""What a harness run tells a person: terminal summary, JSON, JUnit XML, ownership plot.

`RunReport` takes the per-(implementation, preset, CP group) result dicts that
the ranks all-gathered and renders them. The terminal gets a table per preset,
group and rank (tokens owned vs expected, duplicates, misses, wrong slots, KV
read back, steps), the corner counts, per-rank time and memory, the verdict,
and the first violation with a one-line command that reproduces it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from typing import TextIO

from .checks import CHECKS, Violation


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


def _group_kind(g: dict, cp_size: int) -> str:
    if not g["enabled"]:
        return "disabled"
    kind = "sharded" if g["sharded"] and cp_size > 1 else "unsharded" if cp_size > 1 else "cp1"
    return kind + (f"+win{g['window']}" if g["window"] else "")


class RunReport:
    """All results of one run and the ways to show them."""

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

    # ------------------------------------------------------------ rendering

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

    def render(self) -> str:
        lines = [
            f"cp-blocktables verify: world size {self.world_size}, backend {self.backend}, "
            f"seed {self.opts.seed}"
        ]
        for note in self.opts.skipped:
            lines.append(f"skipped: {note}")
        header = (
            f"{'preset':<16} {'seed':>4} {'grp':>3} {'kind':<14} {'rank':>4} "
            f"{'owned/expected':>17} {'dup':>4} {'miss':>4} {'wrong':>5} "
            f"{'read back':>15} {'steps':>5}"
        )
        current_impl = None
        for r in self.results:
            if r["impl"] != current_impl:
                current_impl = r["impl"]
                lines += ["", f"implementation {current_impl}", header, "-" * len(header)]
            for s in r["stats"]:
                g = r["groups"][s["group"]]
                lines.append(
                    f"{r['preset']:<16} {r['seed']:>4} {s['group']:>3} "
                    f"{_group_kind(g, r['cp_size']):<14} {s['rank']:>4} "
                    f"{s['owned']:>8}/{s['expected']:<8} {s['duplicates']:>4} {s['misses']:>4} "
                    f"{s['wrong_slots']:>5} {s['read_back']:>7}/{s['read_expected']:<7} "
                    f"{r['steps_checked']:>5}"
                )
        lines += ["", "corners reached (summed over CP groups; * = promised by the preset):"]
        lines += self._corner_lines()
        lines += [
            "",
            "per rank: "
            + "; ".join(
                f"rank {i['rank']} ({i.get('backend', '?')}, {i.get('device', '?')}): "
                f"{i['wall_s']:.1f} s, {i['max_rss_mb']:.0f} MB peak RSS, {i['tokens']} tokens, "
                f"{1e3 * i.get('gather_s', 0.0) / max(i.get('steps', 0), 1):.2f} ms gather a step"
                for i in self.ranks
            ),
        ]
        lines += [""] + self._verdict_lines()
        return "\n".join(lines) + "\n"

    def _corner_lines(self) -> list[str]:
        lines, seen = [], {}
        for r in self.results:
            key = r["preset"]
            agg = seen.setdefault(
                key,
                {
                    "corners": {},
                    "promised": set(r["promised"]),
                    "missing": set(r["missing_corners"]) if r["coverage_enforced"] else set(),
                },
            )
            for c, n in r["corners"].items():
                agg["corners"][c] = agg["corners"].get(c, 0) + n
        for name, agg in seen.items():
            items = [
                f"{c}{'*' if c in agg['promised'] else ''}={n}"
                for c, n in agg["corners"].items()
                if n or c in agg["promised"]
            ]
            lines.append(f"  {name}: " + ", ".join(items))
        return lines

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

    def as_dict(self) -> dict:
        opts = {k: v for k, v in vars(self.opts).items()}
        return {
            "passed": self.passed(),
            "world_size": self.world_size,
            "backend": self.backend,
            "options": opts,
            "checks": CHECKS,
            "implementations": self.impl_verdicts(),
            "ranks": self.ranks,
            "results": [
                dict(r, failures=self.failures(r), repro=self.repro(r)) for r in self.results
            ],
        }

    def junit(self) -> str:
        suite = ET.Element("testsuite", name="cp-blocktables verify")
        cases = failures = 0
        for r in self.results:
            for k, rank in enumerate(r["ranks"]):
                cases += 1
                case = ET.SubElement(
                    suite,
                    "testcase",
                    classname=f"verify.{r['impl']}",
                    name=f"{r['preset']}[seed {r['seed']}, rank {rank}]",
                    time=f"{r['wall_s']:.3f}",
                )
                mine = [v for v in r["violations"] if v["rank"] in (k, None)]
                text = [Violation(**v).describe() for v in mine[:1]]
                if r["coverage_enforced"] and r["missing_corners"]:
                    text.append(f"missing corners: {', '.join(r['missing_corners'])}")
                if text:
                    failures += 1
                    f = ET.SubElement(case, "failure", message=text[0])
                    f.text = "\n".join(text + [f"reproduce: {self.repro(r)}"])
        suite.set("tests", str(cases))
        suite.set("failures", str(failures))
        return ET.tostring(suite, encoding="unicode") + "\n"

    def plot(self, path: str) -> None:
        """PNG of which rank wrote each position of one request (the interleave, visible)."""
        candidates = [r for r in self.results if r["plot"]]
        if not candidates:
            print("cp-blocktables: --plot: no request to plot", file=sys.stderr)
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        chosen = max(
            candidates, key=lambda r: (r["plot"]["cp_size"] > 1, r["plot"]["interleave"] > 1)
        )
        p = chosen["plot"]
        c, bs, inter = p["cp_size"], p["block_size"], p["interleave"]
        span = min(max(pos for pos, _ in p["points"]) + 1, 4 * bs * c)
        grid = np.zeros((c, span))
        for pos, k in p["points"]:
            if pos < span:
                grid[k, pos] += 1
        fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * c))
        ax.imshow(
            grid,
            aspect="auto",
            cmap="Blues",
            vmin=0,
            vmax=max(1, grid.max()),
            interpolation="nearest",
        )
        for x in range(0, span, bs * c):
            ax.axvline(x - 0.5, color="red", linewidth=0.8)
        ax.set_yticks(range(c), [f"rank {k}" for k in range(c)])
        ax.set_xlabel("position (red lines: virtual block boundaries)")
        ax.set_title(
            f"{chosen['preset']}: request {p['request']}, group {p['group']}, "
            f"cp_size {c}, interleave {inter}, block size {bs}: rank that wrote each "
            f"position",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def _write(path: str, text: str) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
