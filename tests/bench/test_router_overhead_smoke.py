"""The router-hop benchmark runs end to end (stub instances and the real router, each in its own
process) and writes its JSON; on a busy CPU host its numbers are smoke figures."""

from __future__ import annotations

import json


def test_router_overhead_writes_json(tmp_path, capsys):
    from bench.router_overhead import main

    out = tmp_path / "router.json"
    main(["--lengths", "16,64", "--requests", "4", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [16, 64]
    for r in rows:
        assert r["direct_p50_ms"] > 0 and 0 < r["router_p50_ms"] <= r["router_p99_ms"]
    assert "router p50" in capsys.readouterr().out
