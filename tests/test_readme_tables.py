"""scripts/readme_tables.py on a small README and fake reports: --update copies each marked
table from its report, --check lists what differs, and bad markers or reports are named."""

from __future__ import annotations

from pathlib import Path

import pytest
from readme_script import load_readme_tables

REPO = Path(__file__).resolve().parent.parent


rt = load_readme_tables()

ERRORS = """\
## Norms: integer op vs float op

**int8**

| op | N=64 |
|---|---|
| L2 | 0.50 |

**int4**

| op | N=64 |
|---|---|
| L2 | 0.75 |

## Spiking

| config | agreement |
|---|---|
| hard | 99.00 % |
"""

BENCH = """\
# benchmarks

- date: today

## Kernel throughput

Machine: a test box.

### P1: kernels

| op | speedup |
|---|---:|
| IntLayerNorm | 0.70× |

Speedup goal met in 0 of 1 cases.

### P2: L1 vs L2

| shape | L1 speedup |
|---|---:|
| 8×64 | 1.01× |

## P4: compile time

| model | cold |
|---|---:|
| mixer | 6.0 s |
"""

ACCURACY = """\
| model | test accuracy |
|---|---:|
| transformer | 97.00 % |

Goal: met.
"""

README = """\
# project

Prose stays as it is.

<!-- from: out/error_table.md, section "Norms", table 2 (make demo) -->

| op | N=64 |
|---|---|
| L2 | 0.10 |

<!-- end -->

Between the tables.

<!-- from: out/bench.md, section "P2" (make bench) -->
| shape | L1 speedup |
|---|---:|
| 8×64 | 1.01× |
<!-- end -->

<!-- from: out/train/accuracy.md (make demo) -->

| stale | header |
|---|---|

<!-- end -->
The end.
"""

UPDATED = README.replace("| L2 | 0.10 |", "| L2 | 0.75 |").replace(
    "| stale | header |\n|---|---|", "| model | test accuracy |\n|---|---:|\n| transformer | 97.00 % |"
)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A README with three markers and the reports they quote."""
    (tmp_path / "out" / "train").mkdir(parents=True)
    (tmp_path / "out" / "error_table.md").write_text(ERRORS)
    (tmp_path / "out" / "bench.md").write_text(BENCH)
    (tmp_path / "out" / "train" / "accuracy.md").write_text(ACCURACY)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    return readme


def test_markers_are_read_with_their_source_section_table_and_command():
    markers = rt.parse_markers(README)
    assert [(m.source, m.section, m.table, m.command, m.line) for m in markers] == [
        ("out/error_table.md", "Norms", 2, "make demo", 5),
        ("out/bench.md", "P2", 1, "make bench", 15),
        ("out/train/accuracy.md", None, 1, "make demo", 21),
    ]


def test_check_names_each_differing_table_and_exits_1(checkout, capsys):
    assert rt.main(["--check", "--readme", str(checkout)]) == 1
    out = capsys.readouterr().out
    assert 'README.md:5: out/error_table.md, section "Norms", table 2 (make demo): differs from the report' in out
    assert "    -| L2 | 0.10 |\n    +| L2 | 0.75 |" in out
    assert "README.md:21: out/train/accuracy.md, table 1 (make demo): differs from the report" in out
    assert "P2" not in out  # identical: not listed
    assert "3 quoted table(s): 1 as in their reports, 2 differ, 0 without a readable report" in out
    assert checkout.read_text() == README  # --check writes nothing


def test_update_copies_the_tables_verbatim_and_nothing_else(checkout, capsys):
    assert rt.main(["--update", "--readme", str(checkout)]) == 0
    assert checkout.read_text() == UPDATED
    assert "2 updated" in capsys.readouterr().out
    assert rt.main(["--check", "--readme", str(checkout)]) == 0


def test_update_of_an_up_to_date_readme_leaves_the_file_alone(checkout):
    checkout.write_text(UPDATED)
    before = checkout.stat().st_mtime_ns
    assert rt.main(["--update", "--readme", str(checkout)]) == 0
    assert checkout.read_text() == UPDATED and checkout.stat().st_mtime_ns == before


def test_a_missing_report_is_named_with_its_command_and_the_rest_still_update(checkout, capsys):
    (checkout.parent / "out" / "bench.md").unlink()
    (checkout.parent / "out" / "train" / "accuracy.md").unlink()
    assert rt.main(["--update", "--readme", str(checkout)]) == 1
    out = capsys.readouterr().out
    assert "README.md:15: out/bench.md, section \"P2\", table 1 (make bench): out/bench.md does not exist: " \
           "run `make bench` first" in out
    assert "out/train/accuracy.md does not exist: run `make demo` first" in out
    assert "| L2 | 0.75 |" in checkout.read_text()  # the error table was still copied
    assert "| stale | header |" in checkout.read_text()


HEADINGS = "headings: benchmarks; Kernel throughput; P1: kernels; P2: L1 vs L2; P4: compile time"


@pytest.mark.parametrize(
    ("section", "table", "message"),
    [
        ("P3", 1, f'no heading starting with "P3" ({HEADINGS})'),
        ("P", 1, f'3 headings starting with "P" ({HEADINGS})'),
        ("P1", 2, 'section "P1" has 1 table(s), not a table 2'),
        (None, 4, "the report has 3 table(s), not a table 4"),
    ],
)
def test_a_section_or_table_the_report_lacks_is_named(section, table, message):
    with pytest.raises(rt.SourceError) as err:
        rt.extract_table(BENCH, section, table)
    assert str(err.value) == message


def test_a_section_holds_its_subsections_and_ends_at_the_next_heading_of_its_level():
    assert rt.extract_table(BENCH, "Kernel throughput", 2) == [
        "| shape | L1 speedup |", "|---|---:|", "| 8×64 | 1.01× |"
    ]
    with pytest.raises(rt.SourceError, match="has 2 table"):
        rt.extract_table(BENCH, "Kernel throughput", 3)  # P4's table is past the section
    assert rt.extract_table(BENCH, None, 3) == ["| model | cold |", "|---|---:|", "| mixer | 6.0 s |"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a\n<!-- from: out/x.md -->\n<!-- end -->\n", "line 2: cannot read the marker"),
        ("<!-- from: out/x.md (make demo) -->\n| a |\n", "line 1: the marker is never closed"),
        ("| a |\n<!-- end -->\n", "line 2: <!-- end --> without an opening"),
        ("<!-- from: out/x.md (make demo) -->\n<!-- from: out/y.md (make demo) -->\n<!-- end -->\n",
         "line 2: a marker opens before the one on line 1 is closed"),
        ('<!-- from: out/x.md, table 0 (make demo) -->\n<!-- end -->\n', "line 1: cannot read the marker"),
    ],
)
def test_malformed_markers_exit_2_naming_the_line(tmp_path, capsys, text, message):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    with pytest.raises(rt.MarkerError, match=message):
        rt.parse_markers(text)
    assert rt.main(["--check", "--readme", str(readme)]) == 2
    assert message in capsys.readouterr().err


def test_a_marker_quoted_inside_a_line_of_prose_is_not_a_marker():
    text = 'Markers look like `<!-- from: out/bench.md, section "P1" (make bench) -->` in the source.\n'
    assert rt.parse_markers(text) == []
