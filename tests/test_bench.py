"""``moerun bench`` on the CPU: runs on the tiny preset, writes its JSON, and skips CUDA graphs cleanly."""

from __future__ import annotations

import json

from moerun.cli import main


def test_bench_tiny_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prefill-lens", "8,32",
            "--batch-sizes", "1,3", "--prompt-len", "8", "--steps", "3", "--max-model-len", "128",
            "--out", str(out)]
    assert main(args) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["cuda_graphs"] is False
    assert set(result["prefill"]) == {"8", "32"}
    assert set(result["decode"]) == {"1", "3"}
    assert all(d["tok_per_s"] > 0 and d["bytes_per_step"] > 0 for d in result["decode"].values())
    assert "decode    batch" in capsys.readouterr().out


def test_bench_vs_transformers_shares_weights(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prefill-lens", "16",
            "--batch-sizes", "1", "--prompt-len", "8", "--steps", "2", "--max-model-len", "64",
            "--vs", "transformers", "--hf-batch-sizes", "1", "--out", str(out)]
    assert main(args) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["hf_logits_check"] < 1e-5  # the same model, computed by both engines
    assert any(e.get("decode", {}).get("1") for e in result["hf"].values())
