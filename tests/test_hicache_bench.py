"""``radixserve bench --hicache`` end to end on the tiny model (small sizes): every tier
configuration runs, the tables and the plot are written, and the numbers hang together."""

from __future__ import annotations

import json

import pytest

from radixserve.bench.metrics import trie_nodes
from radixserve.bench.workloads import drive, make_workload

SMALL = ["--param", "multi-turn-tiered.num_conversations=6", "--param", "multi-turn-tiered.turns=3",
         "--param", "multi-turn-tiered.turn_tokens=24", "--param", "multi-turn-tiered.reply_tokens=24",
         "--engine-arg", "dtype=float32", "--engine-arg", "hicache_storage_page_tokens=16"]


def test_tiered_workload_prompts_do_not_depend_on_outputs(tiny_loaded):
    w = make_workload("multi-turn-tiered", tiny_loaded.tokenizer, num_conversations=3, turns=3,
                      turn_tokens=16, reply_tokens=16)
    a = drive(w, lambda rs: {r.id: "" for r in rs})
    b = drive(w, lambda rs: {r.id: " whatever the model said" for r in rs})
    assert [[r.prompt for r in rr] for rr in a] == [[r.prompt for r in rr] for rr in b]
    assert [len(rr) for rr in a] == [3, 3, 3]
    for t in (1, 2):  # each turn extends the same conversation's previous prompt
        assert all(a[t][i].prompt.startswith(a[t - 1][i].prompt) for i in range(3))


def test_bench_hicache_tiny(tmp_path, capsys):
    from radixserve.bench.cli import main
    from radixserve.bench.redis_local import redis_server_binary

    rc = main(["--hicache", "--model", "tiny-random", "--output-dir", str(tmp_path),
               "--no-progress", *SMALL])
    assert rc == 0
    out = capsys.readouterr().out
    configs = ["L1 unbounded", "L1 only", "L1+L2", "L1+L2+file"]
    if redis_server_binary() is not None:
        configs.append("L1+L2+Redis")
    for c in configs:
        assert f"| {c} |" in out
    assert "| config | L1 tokens | L2 tokens |" in out and "warm / cold" in out
    data = json.loads((tmp_path / "results.json").read_text())
    (res,) = data["results"]
    rows = {r["config"]: r for r in res["rows"]}
    assert list(rows) == configs
    assert all(r["errors"] == 0 and r["requests"] == 18 for r in rows.values())
    # L1 is a quarter of the working set: alone it loses hits that L2 brings back.
    assert rows["L1 only"]["hit_rate"] < rows["L1 unbounded"]["hit_rate"]
    assert rows["L1+L2"]["hit_rate"] >= 0.95 * rows["L1 unbounded"]["hit_rate"]
    assert rows["L1+L2"]["hit_tiers"]["L2"] > 0 and rows["L1+L2"]["loaded_tokens"] > 0
    assert rows["L1+L2+file"]["l3_pages_stored"] > 0
    assert res["l1"] == res["working_set"] // 4
    for r in res["restarts"]:  # the warm engine serves the replay from storage
        assert r["hit_warm"] > r["hit_cold"] and r["l3_tokens"] > 0
    assert (tmp_path / "tiers.png").stat().st_size > 1000
    assert (tmp_path / "results.md").read_text().count("| L1+L2 |") == 1


def test_working_set_counts_distinct_prompt_tokens(tiny_loaded):
    from radixserve.bench.tiered import plan_tiers, working_set_tokens

    tok = tiny_loaded.tokenizer
    w = make_workload("multi-turn-tiered", tok, num_conversations=2, turns=2, turn_tokens=8,
                      reply_tokens=8, max_tokens=3)
    prompts = [r.prompt for rr in drive(w, lambda rs: {}) for r in rr]
    assert working_set_tokens(w, tok.encode) == trie_nodes([tok.encode(p) for p in prompts]) + 4 * 3
    plan = plan_tiers(1000, 256, 2048, 4, "file:///tmp/x", None)
    assert [c.name for c in plan] == ["L1 unbounded", "L1 only", "L1+L2", "L1+L2+file"]
    assert plan[0].kv_cache_tokens > 1000 and plan[0].kv_cache_tokens % 4 == 0
    assert plan[3].engine_options()["hicache_storage"] == "file:///tmp/x"


def test_bench_hicache_rejects_online(capsys):
    from radixserve.bench.cli import main

    with pytest.raises(SystemExit):
        main(["--hicache", "--bogus"])
    assert main(["--hicache", "--model", "tiny-random", "--url", "http://127.0.0.1:1"]) == 2
