"""Classifying mutants, their ids, the allowlist, annotation spans and the figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from cp_blocktables.mutate import outcome, session
from cp_blocktables.mutate.probe import INCOMPETENT_MARKER
from cp_blocktables.mutate.reach import NOT_REACHED_MARKER

ROOT = Path(__file__).resolve().parents[2]
DIFF = """--- mutation diff ---
--- a//tmp/s/cpbt_mutant/x.py
+++ b//tmp/s/cpbt_mutant/x.py
@@ -10,3 +10,3 @@
 a = 1
-b = a + 1
+b = a - 1
 c = 2
"""


def mutant(**kw) -> session.Mutant:
    base = dict(
        job_id="j",
        module_path="/tmp/s/cpbt_mutant/x.py",
        operator="core/ReplaceBinaryOperator_Add_Sub",
        occurrence=0,
        line=11,
        definition="f",
        worker_outcome="normal",
        test_outcome="killed",
        output="FAIL",
        diff=DIFF,
    )
    base.update(kw)
    return session.Mutant(**base)


def test_classes():
    assert outcome.classify(mutant()) == "killed"
    assert outcome.classify(mutant(output="timeout")) == "timeout"
    assert outcome.classify(mutant(test_outcome="survived", output="PASS")) == "survived"
    assert outcome.classify(mutant(output=f"{INCOMPETENT_MARKER}: importing x")) == "incompetent"
    assert outcome.classify(mutant(test_outcome="incompetent")) == "incompetent"
    assert outcome.classify(mutant(worker_outcome="exception")) == "incompetent"
    assert outcome.classify(mutant(worker_outcome="skipped", test_outcome=None)) is None
    assert outcome.classify(mutant(worker_outcome=None, test_outcome=None)) is None
    skipped = mutant(worker_outcome="skipped", test_outcome=None, output=session.ANNOTATION_SKIP)
    assert outcome.classify(skipped) == "annotation"


def test_ids_ignore_line_numbers_but_not_the_change():
    moved = DIFF.replace("@@ -10,3 +10,3 @@", "@@ -90,3 +90,3 @@")
    a = outcome.mutant_id("x.py", "op", "f", DIFF)
    assert a == outcome.mutant_id("x.py", "op", "f", moved)
    assert a != outcome.mutant_id("x.py", "op", "f", DIFF.replace("a - 1", "a * 1"))
    assert a != outcome.mutant_id("y.py", "op", "f", DIFF)
    assert a.startswith("m-") and len(a) == 12


def test_allowlist_reads_only_headings_of_its_section(tmp_path):
    doc = tmp_path / "m.md"
    doc.write_text(
        "## Survivors\n### m-0000000001 not this one\n"
        "## Equivalent mutants\n### m-00000000aa kernels.py:3\nm-00000000bb in prose\n"
        "### m-00000000cc, m-00000000dd\n## Gaps\n### m-00000000ee\n"
        "## Outside the contract\n### m-00000000ff\n"
        "## GPU only\n### m-0000000aff\n"
    )
    assert outcome.read_allowlist(doc) == {
        "m-00000000aa": "equivalent",
        "m-00000000cc": "equivalent",
        "m-00000000dd": "equivalent",
        "m-00000000ff": "outside",
        "m-0000000aff": "gpu",
    }
    assert outcome.read_allowlist(tmp_path / "missing.md") == {}


def test_verdicts_use_the_original_file_name_and_the_allowlist():
    survivor = mutant(test_outcome="survived", output="PASS")
    origins = {survivor.module_path: "cp_blocktables/x.py"}
    (v,) = outcome.verdicts([survivor], origins, {})
    assert v.module == "cp_blocktables/x.py" and v.outcome == "survived"
    assert "a/cp_blocktables/x.py" in v.diff and "mutation diff" not in v.diff
    (w,) = outcome.verdicts([survivor], origins, {v.id: "equivalent"})
    assert w.outcome == "equivalent"
    (x,) = outcome.verdicts([survivor], origins, {v.id: "outside"})
    assert x.outcome == "outside"
    s = outcome.summarize([x], total=1)
    assert (s["survived"], s["outside_contract"], s["unexplained_survivors"]) == (1, 1, 0)
    (y,) = outcome.verdicts([survivor], origins, {v.id: "gpu"})
    s = outcome.summarize([y], total=1)
    assert (s["survived"], s["gpu_only"], s["unexplained_survivors"]) == (1, 1, 0)
    assert s["kill_rate_excluding_equivalent"] == 1.0  # argued: out of the denominator
    assert "GPU only (allowlisted)" in outcome.render(s, [y])


def test_summary_figures():
    vs = outcome.verdicts(
        [
            mutant(),
            mutant(output="timeout"),
            mutant(test_outcome="survived", output="PASS", diff=DIFF.replace("-", "*", 0)),
            mutant(output=INCOMPETENT_MARKER),
        ],
        {},
        {},
    )
    s = outcome.summarize(vs, total=10, annotation=3)
    assert (s["killed"], s["timeout"], s["survived"], s["incompetent"]) == (1, 1, 1, 1)
    assert s["mutants_run"] == 4 and s["annotation_skipped"] == 3
    assert abs(s["kill_rate"] - 2 / 3) < 1e-9
    assert "kill rate: 66.7%" in outcome.render(s, vs)


@pytest.mark.parametrize(
    ("argued", "cls", "unexplained"),
    [
        (None, "survived", 1),
        ("equivalent", "equivalent", 0),
        ("outside", "outside", 0),
        ("gpu", "gpu", 0),
    ],
    ids=["unargued", "equivalent", "outside", "gpu-only"],
)
def test_a_not_reached_survivor_is_a_survivor_counted_apart(argued, cls, unexplained):
    unrun = mutant(test_outcome="survived", output=f"{NOT_REACHED_MARKER}: line 11")
    ran = mutant(test_outcome="survived", output="PASS", diff=DIFF.replace("a - 1", "a * 1"))
    (mid,) = {v.id for v in outcome.verdicts([unrun], {}, {})}
    allowlist = {mid: argued} if argued else {}
    v, w, k = outcome.verdicts([unrun, ran, mutant()], {}, allowlist)
    assert (v.outcome, v.not_reached, w.not_reached, k.not_reached) == (cls, True, False, False)
    assert v.as_dict()["not_reached"] is True
    s = outcome.summarize([v, w, k], total=3)
    assert (s["mutants_run"], s["not_reached"], s["survived"]) == (2, 1, 2)
    assert s["unexplained_survivors"] == unexplained + 1
    assert abs(s["kill_rate"] - 1 / 3) < 1e-9  # a survivor in the kill rate
    text = outcome.render(s, [v, w, k])
    assert "1 in statements the harness never runs, not run" in text and "; 1 not reached)" in text
    assert f"{v.id} {outcome._TAGS.get(cls, 'SURVIVED')}, not reached:" in text
    assert f"{w.id} SURVIVED:" in text


def test_annotation_spans_only_when_annotations_are_postponed():
    src = "from __future__ import annotations\ndef f(x: int | None) -> A | B:\n    y: C | D = 1\n"
    spans = session.annotation_spans(src)
    assert ((2, 9), (2, 19)) in spans and ((2, 24), (2, 29)) in spans
    assert ((3, 7), (3, 12)) in spans
    assert session.annotation_spans(src.split("\n", 1)[1]) == []


def test_docs_allowlist_ids_are_well_formed():
    doc = ROOT / "docs" / "mutation-survivors.md"
    if doc.is_file():
        for mid in outcome.read_allowlist(doc):
            assert len(mid) == 12
