"""The llama.cpp peer (bench/llamacpp.py): it skips with a reason where llama-cpp-python is not
installed, decodes a GGUF model's own file, and writes a synthetic preset as a BF16 GGUF that
holds the very weights the engine runs. Its GPU run (llama-cpp-python built with CUDA) is
checked against the numpy reference's greedy tokens."""
import sys

import numpy as np
import pytest

from bench import llamacpp, peers
from onegraph.synth import iter_tensors, preset_config


def test_skips_with_a_reason_without_llama_cpp(monkeypatch):
    pytest.importorskip("gguf")  # without it the gguf reason comes first (the next test)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert llamacpp.unavailable().startswith("llama-cpp-python is not installed")
    r = peers.run_peer("llama.cpp", preset_config("tiny-dense"), None, prompt=[1, 2], n=2, repeats=1)
    assert r["status"] == "skipped" and r["reason"].startswith("llama-cpp-python is not installed")
    assert peers.unavailable("llama.cpp", "cpu") == "the llama.cpp peer runs on the GPU only"


def test_skips_with_a_reason_without_gguf(monkeypatch):
    """A preset reaches llama.cpp as a GGUF file that the gguf package writes."""
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert llamacpp.unavailable().startswith("the gguf package is not installed")
    r = peers.run_peer("llama.cpp", preset_config("tiny-dense"), None, prompt=[1, 2], n=2, repeats=1)
    assert r["status"] == "skipped" and r["reason"].startswith("the gguf package is not installed")


def test_a_gguf_model_is_decoded_from_its_own_file(tmp_path):
    assert llamacpp.gguf_for(None, None, "/models/m.gguf", str(tmp_path)) == "/models/m.gguf"
    assert not list(tmp_path.iterdir())


def test_a_preset_is_written_as_bf16_gguf_with_its_weights(tmp_path):
    gguf = pytest.importorskip("gguf")
    from onegraph.gguf_model import load_gguf
    config = preset_config("tiny-llama")
    tensors = dict(iter_tensors(config))
    path = llamacpp.gguf_for(config, lambda: tensors.items(), None, str(tmp_path))
    reader = gguf.GGUFReader(path)
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == config.vocab_size
    loaded = load_gguf(path)
    for name, ref in tensors.items():  # BF16 holds the synthetic bf16 weights exactly
        np.testing.assert_array_equal(np.asarray(loaded.tensors[name], dtype=np.float32),
                                      np.asarray(ref, dtype=np.float32), err_msg=name)


@pytest.mark.gpu
def test_llama_cpp_decodes_the_reference_tokens():
    """On a GPU with llama-cpp-python: greedy tokens equal the fp32 numpy reference's while its
    top-2 margin is wide enough that bf16 rounding cannot flip them (0.05)."""
    reason = llamacpp.unavailable()
    if reason:
        pytest.skip(reason)
    from onegraph.reference import ReferenceDecoder
    config = preset_config("tiny-llama")
    tensors = dict(iter_tensors(config))
    prompt, n = [3, 17, 250, 9], 8
    out = llamacpp.run_peer(config, lambda: tensors.items(), prompt=prompt, n=n, repeats=1)
    assert out["status"] == "ok", out.get("reason")
    run = out["runs"][0]
    assert len(run["step_ms"]) == n and len(run["tokens"]) == n + 1
    ref = ReferenceDecoder(config, tensors, kv_dtype="fp32", max_seq_len=len(prompt) + n + 1)
    for t in prompt:
        logits = ref.step(t)
    compared = 0
    for got in run["tokens"]:
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] < 0.05:
            break
        assert got == int(np.argmax(logits)), f"token {compared}: llama.cpp {got}, reference {int(np.argmax(logits))}"
        compared += 1
        logits = ref.step(got)
    assert compared >= 1, "the reference's first top-2 margin is under 0.05: pick another prompt"


def test_bench_record_of_a_gguf_counts_the_files_bytes(monkeypatch, tmp_path):
    """bench: llama.cpp on a GGUF model decodes that file; its floor counts the file's bytes."""
    from bench import measure, targets
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 1000)
    seen = {}

    def fake_run_peer(peer, config, source, *, prompt, n, repeats, device, model_path=None):
        seen["model_path"] = model_path
        return {"status": "ok", "reason": None, "load_s": 0.0, "warmup_s": 0.0, "device_bytes": None,
                "details": {}, "runs": [{"ttft_ms": 1.0, "step_ms": [1.0] * n, "tokens": [0] * (n + 1)}]}

    monkeypatch.setattr(peers, "run_peer", fake_run_peer)
    config = preset_config("tiny-dense")
    target = targets.Target("m", config, None, str(model))
    r = measure.bench_peer("llama.cpp", target, targets.Settings(n=4, repeats=1), bandwidth=1e12)
    assert seen["model_path"] == str(model)
    assert r["weights"] == "gguf" and r["kv"] == "f16"
    assert r["bytes_per_token"]["weights"]["total"] == 1000
    assert r["bytes_per_token"]["total"] == 1000 + r["bytes_per_token"]["kv_read"]
