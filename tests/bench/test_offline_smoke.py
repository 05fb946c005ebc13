"""The offline benchmark runs end to end and writes its JSON (numbers on the CPU are smoke figures)."""

from __future__ import annotations

import json


def test_offline_benchmark_writes_json(tiny_dir, tmp_path, capsys):
    from bench.offline import main

    out = tmp_path / "offline.json"
    main(
        [
            "--model",
            tiny_dir("deepseek_v2"),
            "--num-prompts",
            "4",
            "--input-len",
            "12",
            "--output-len",
            "5",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    row = json.loads(out.read_text())
    assert row["num_prompts"] == 4 and row["output_tokens_per_s"] > 0
    assert "output_tokens_per_s" in capsys.readouterr().out
