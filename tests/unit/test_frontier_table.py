"""``scripts/frontier_table.py``: rows grouped by label, ratios against DDP and fp32 DiLoCo."""

from __future__ import annotations

from tests.helpers.scripts import load_script

frontier_table = load_script("frontier_table")


def _run(label: str, loss: float, sent: float, seed: int) -> dict:
    return {"strategy": label, "status": "ok", "seed": seed, "val_loss": loss, "bytes_sent_per_rank": sent,
            "step_s_median": 0.5, "comm_s_per_step": 0.1}


def test_ratios_are_against_ddp_and_fp32_diloco_over_seed_means():
    report = {"runs": [_run("ddp", 4.0, 1000.0, 1), _run("ddp", 4.2, 1000.0, 2),
                       _run("diloco", 4.4, 100.0, 1),
                       _run("diloco[compression=sparse,density=0.01]", 4.62, 1.0, 1),
                       {"strategy": "diloco[compression=int8]", "status": "failed: boom"}]}
    table = frontier_table.frontier(report, {"ddp": 0.6, "none": 0.02, "sparse@0.01": 0.01})
    rows = {line.split(" | ")[0].strip("| `"): line for line in table.splitlines()[2:]}
    assert set(rows) == {"ddp", "diloco", "diloco[compression=sparse,density=0.01]"}   # the failed run has no row
    assert "4.1000 ± 0.1000" in rows["ddp"]
    sparse = rows["diloco[compression=sparse,density=0.01]"].split(" | ")
    assert sparse[4] == "1,000×" and sparse[5] == "+12.68 %"     # vs DDP's mean loss 4.1
    assert sparse[6] == "100×" and sparse[7] == "+5.00 %"       # vs fp32 DiLoCo
    assert sparse[8].rstrip(" |") == "0.410"                    # 0.5 - 0.1 compute + 0.01 measured sync


def test_codec_keys_match_the_bench_reports():
    assert frontier_table.codec_key("diloco[compression=sparse,density=0.03]") == "sparse@0.03"
    assert frontier_table.codec_key("diloco[compression=int8]") == "int8"
    assert frontier_table.codec_key("diloco") == "none" and frontier_table.codec_key("ddp") == "ddp"
