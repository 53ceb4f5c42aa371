"""The moerun command line: make-tiny, generate (streaming), chat, inspect, and its errors."""

from __future__ import annotations

import io

import pytest

from moerun.cli import main


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_generate_with_the_builtin_demo_model(demo_cache, monkeypatch, capsys):
    monkeypatch.setenv("MOERUN_CACHE", str(demo_cache))
    assert main(["generate", "--prompt", "Hello", "--max-tokens", "12", "--temperature", "0", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert "weights are RANDOM" in err
    assert len(out.strip()) > 0
    assert (demo_cache / "tiny-qwen3-moe" / "model.safetensors").exists()


def test_generate_matches_the_api(tiny_checkpoint, tiny_llm, capsys):
    from moerun import SamplingParams

    args = ["generate", "--model", str(tiny_checkpoint), "--prompt", "The sky", "--max-tokens", "10",
            "--temperature", "0", "--ignore-eos", "--device", "cpu", "--max-model-len", "512"]
    assert main(args) == 0
    out = capsys.readouterr().out
    expected = tiny_llm.generate(["The sky"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].text
    assert out == expected + "\n"


def test_generate_reads_stdin(tiny_checkpoint, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    assert main(["generate", "--model", str(tiny_checkpoint), "--max-tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_chat_until_exit(tiny_checkpoint, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\nagain\n/exit\n"))
    assert main(["chat", "--model", str(tiny_checkpoint), "--max-tokens", "4", "--device", "cpu", "--no-think"]) == 0
    assert capsys.readouterr().out.count(">>> ") == 4


def test_make_tiny_and_inspect(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-tiny", str(out), "--layers", "2", "--experts", "4", "--seed", "3"]) == 0
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "layers               2 (2 MoE, 0 dense)" in text
    assert "experts              4 per layer, 2 active" in text
    assert "BF16" in text


def test_errors_exit_2_with_a_message(tiny_checkpoint, tmp_path, capsys):
    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_demo_runs_without_triton(demo_cache, tmp_path):
    # Triton is a test extra: the base install (`pip install -e .`) must generate without it, on every CLI path
    # that imports the offloading and quantized modules.
    import os
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"  # any `import triton` now fails
            "from moerun.cli import main\n"
            "import moerun.moe.offload, moerun.moe.offload.zero_copy, moerun.engine.layer_graphs\n"
            # the graphs' greedy pick on its torch path (what CUDA graphs capture without Triton)
            "import torch; from moerun.ops import greedy_pick\n"
            "ids = torch.zeros(1, dtype=torch.long); greedy_pick(torch.tensor([[0.0, 2.0]]), torch.empty(1, 2), ids)\n"
            "assert ids.tolist() == [1]\n"
            "sys.exit(main(['generate', '--prompt', 'Hello', '--max-tokens', '3', '--temperature', '0']))\n")
    env = {**os.environ, "MOERUN_CACHE": str(demo_cache)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
