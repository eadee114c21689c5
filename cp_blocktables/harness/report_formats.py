"""Renderings of a harness run's report: the terminal table, JSON and JUnit XML.

`_Formats` is a mixin of `report.RunReport`: it reads the run's results and
the verdict (`failures`, `repro`, `impl_verdicts`, `_verdict_lines`) and
turns them into text; `plot` draws the ownership plot (`report_plot`).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from .checks import CHECKS, Violation
from .report_plot import ownership_plot


def _group_kind(g: dict, cp_size: int) -> str:
    if not g["enabled"]:
        return "disabled"
    kind = "sharded" if g["sharded"] and cp_size > 1 else "unsharded" if cp_size > 1 else "cp1"
    return kind + (f"+win{g['window']}" if g["window"] else "")


class _Formats:
    """The terminal table, the JSON document, the JUnit XML and the plot of one run."""

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
        ownership_plot(self.results, path)
