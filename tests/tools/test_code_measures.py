"""The code measures (`tests/tools/code_measures.py`) run over the package: no cycles between
packages, no nested conditional expressions, no line past the formatter's 100 columns by far."""

from __future__ import annotations

from tests.tools.code_measures import cycles, measure, report


def test_cycles_found_in_a_small_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_package_measures():
    m = measure()
    print(report(m))
    assert m.nonblank > 1000
    assert m.cycles == [], f"packages import each other: {m.cycles}"
    assert m.nested_conditionals == 0
    assert m.functions and m.functions[0][0] >= m.functions[-1][0]
