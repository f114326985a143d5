"""``--hf-config DIR``: any causal LM transformers builds from a config.json, trained by the
harness (and so by ``offloadd wall``), with errors naming the path, the key and the value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from offloadd import cli
from offloadd.tools.harness.train import RunSpec, run
from offloadd.tools.models.hf_config import HFConfigError, build_causal_lm, load_config

tf = pytest.importorskip("transformers")

ENGINE_PARAMS = ("default",)

SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "vocab_size": 100}
SMALL |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
CONFIGS: dict[str, Any] = {
    "gpt2": lambda: tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=100),
    "llama": lambda: tf.LlamaConfig(**SMALL),
    "qwen2": lambda: tf.Qwen2Config(**SMALL),  # Mistral-style: grouped-query attention
    "mixtral": lambda: tf.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
}


def _saved(tmp_path: Path, name: str) -> str:
    d = tmp_path / name
    CONFIGS[name]().save_pretrained(str(d))
    return str(d)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_architecture_trains_and_sac_changes_no_bit(tmp_path: Path, name: str) -> None:
    """GPT-2, Llama, Qwen2 (Mistral-style) and Mixtral (mixture of experts) from their configs:
    the harness trains each, its sizes taken from the config; the sac peer gives the same bits."""
    kw: dict[str, Any] = {"hf_config": _saved(tmp_path, name), "seq_len": 16, "batch_size": 2}
    kw |= {"steps": 1, "warmup": 1}
    plain, sac = run(RunSpec(strategy="none", **kw)), run(RunSpec(strategy="sac", **kw))
    assert plain["params"] > 0 and all(0 < loss < 10 for loss in plain["losses"])
    assert plain["losses"] == sac["losses"] and plain["weights_sha256"] == sac["weights_sha256"]


def test_what_cannot_be_built_is_named(tmp_path: Path) -> None:
    with pytest.raises(HFConfigError, match=r"--hf-config: .*nowhere/config.json not found"):
        load_config(str(tmp_path / "nowhere"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(HFConfigError, match=r"bad/config\.json is not readable JSON"):
        load_config(str(bad))
    (bad / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(HFConfigError, match="has no 'model_type' key"):
        load_config(str(bad))
    (bad / "config.json").write_text(json.dumps({"model_type": "frobnicator"}))
    with pytest.raises(HFConfigError, match=r"model_type 'frobnicator' .* not an architecture"):
        load_config(str(bad))
    t5 = tmp_path / "t5"
    tf.T5Config(num_layers=1, d_model=16, d_ff=32, num_heads=2, d_kv=8).save_pretrained(str(t5))
    with pytest.raises(HFConfigError, match="model_type 't5' has no causal-LM model"):
        build_causal_lm(load_config(str(t5)), seq_len=8, recompute=False, selective=False)
    llama = load_config(_saved(tmp_path, "llama"))
    with pytest.raises(HFConfigError, match=r"--seq 128 .* max_position_embeddings \(64\)"):
        build_causal_lm(llama, seq_len=128, recompute=False, selective=False)


def test_wall_refuses_a_config_it_cannot_build_before_any_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["wall", "--memory-limit", "1GiB", "--out", str(tmp_path / "o")]
    assert cli.main([*args, "--hf-config", str(tmp_path / "missing")]) == 2
    assert "--hf-config" in capsys.readouterr().err
    llama = _saved(tmp_path, "llama")
    assert cli.main([*args, "--hf-config", llama, "--seq", "512"]) == 2
    assert "max_position_embeddings (64)" in capsys.readouterr().err
