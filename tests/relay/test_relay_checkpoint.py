"""Relay from a checkpoint (Note [loading from a checkpoint] in offloadd/relay/loading.py): a
model built on the meta device, filled from what ``save_pretrained`` wrote, trains as the model
loaded whole does; a checkpoint that does not match, or is damaged, is refused by name before
anything is written."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import offloadd
from offloadd.relay import RelayError, from_pretrained, relay_stats, weights_on_meta
from offloadd.relay.checkpoint import CheckpointError
from tests._support.helpers import loop_ext4
from tests.relay.cases import MakeRelayConfig, same, step, train_llama

pytest.importorskip("transformers")


def _config(tied: bool = False) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=172,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        vocab_size=512,
        tie_word_embeddings=tied,
    )


def _freeze(m: nn.Module) -> nn.Module:
    """LoRA-like: every decoder layer frozen, the embeddings, final norm and head trained."""
    for layer in m.model.layers:  # type: ignore[union-attr]
        layer.requires_grad_(False)
    return m


def _saved(tmp: Path, tied: bool = False, **save: Any) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    d = tmp / "ckpt"
    LlamaForCausalLM(_config(tied)).save_pretrained(d, **save)
    return d


def _whole(d: Path, **kw: Any) -> nn.Module:
    from transformers import LlamaForCausalLM

    return _freeze(LlamaForCausalLM.from_pretrained(d, **kw))


def _on_meta(tied: bool = False, dtype: torch.dtype | None = None) -> nn.Module:
    from transformers import LlamaForCausalLM

    with weights_on_meta():
        m = LlamaForCausalLM(_config(tied))
    if dtype is not None:
        m = m.to(dtype)
    return _freeze(m)


def _trains_as(model: nn.Module, want: list[Any]) -> None:
    """``model`` trains step for step as ``want`` (losses and gradients), then is unrelayed."""
    got = train_llama(model, len(want))
    assert all(same(a, b) for a, b in zip(want, got, strict=True))
    offloadd.unrelay(model)


@pytest.mark.parametrize(
    ("tied", "shards"), [(False, "40KB"), (True, None)], ids=["sharded", "tied-one-file"]
)
def test_a_meta_model_trains_as_the_model_loaded_whole(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path, tied: bool, shards: Any
) -> None:
    d = _saved(tmp_path, tied, **({"max_shard_size": shards} if shards else {}))
    assert (d / "model.safetensors.index.json").exists() == (shards is not None)
    want = train_llama(_whole(d))
    model = offloadd.relay(_on_meta(tied), checkpoint=d, config=make_relay_config(disk_dir))
    st = relay_stats(model)
    assert st.groups == 3 and st.written_bytes >= st.relayed_bytes > 0
    if tied:  # one tensor in two places, as the model built it
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(t.is_meta for t in model.state_dict().values())
    _trains_as(model, want)


def test_dtype_converts_as_the_weights_stream_in(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path
) -> None:
    d = _saved(tmp_path)  # float32 on disk
    want = train_llama(_whole(d, dtype=torch.bfloat16), 2)
    model = offloadd.relay(
        _on_meta(), checkpoint=d, dtype="bfloat16", config=make_relay_config(disk_dir)
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    _trains_as(model, want)


def _refused(model: nn.Module, d: Path, cfg: Any, disk_dir: Path) -> str:
    with pytest.raises(RelayError) as err:
        offloadd.relay(model, checkpoint=d, config=cfg)
    assert not list(disk_dir.iterdir())  # nothing written
    return str(err.value)


def test_keys_that_do_not_match_are_named(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    d = _saved(tmp_path)
    cfg = make_relay_config(disk_dir)
    sd = load_file(d / "model.safetensors")
    sd.pop("model.layers.1.mlp.up_proj.weight")
    sd["model.layers.9.extra"] = torch.zeros(2)
    sd["model.norm.weight"] = torch.zeros(65)
    sd["model.layers.0.input_layernorm.weight"] = torch.zeros(64, dtype=torch.int32)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    said = _refused(_on_meta(), d, cfg, disk_dir)
    assert "missing from the checkpoint: model.layers.1.mlp.up_proj.weight" in said
    assert "in the checkpoint but not the model: model.layers.9.extra" in said
    assert "model.norm.weight: [65] in the checkpoint, [64] in the model" in said
    assert (
        "model.layers.0.input_layernorm.weight: torch.int32 in the checkpoint, torch.float32"
        in said
    )


def test_buffers_lost_on_meta_are_named(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    d = _saved(tmp_path)
    with torch.device("meta"):  # the rotary embedding's inv_freq too: its values are gone
        m = _freeze(LlamaForCausalLM(_config()))
    said = _refused(m, d, make_relay_config(disk_dir), disk_dir)
    assert "model.rotary_emb.inv_freq" in said and "weights_on_meta()" in said


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "short":
        del raw[len(raw) - 100 :]
    elif how == "header-length":
        raw[:8] = struct.pack("<Q", len(raw))
    else:  # a flipped byte inside the JSON header
        n = struct.unpack("<Q", raw[:8])[0]
        header = raw[8 : 8 + n].decode()
        at = 8 + header.index('"data_offsets"') + 1
        raw[at] ^= 0x20
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["short", "header-length", "flipped-header"])
def test_a_damaged_file_is_refused_by_name(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path, how: str
) -> None:
    d = _saved(tmp_path, max_shard_size="40KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = d / index["weight_map"]["model.layers.2.mlp.down_proj.weight"]
    _damage(victim, how)
    said = _refused(_on_meta(), d, make_relay_config(disk_dir), disk_dir)
    assert str(victim) in said
    if how == "short":
        assert "short or damaged" in said and "model.layers.2.mlp.down_proj.weight" in said


def _as_torch_files(d: Path) -> Path:
    """``d``'s weights as torch state dicts, in two shards with their index (as transformers
    4 wrote them with ``safe_serialization=False``)."""
    from safetensors.torch import load_file

    sd = load_file(d / "model.safetensors")
    out = d.parent / "torch"
    out.mkdir()
    keys = sorted(sd)
    shards = {
        "pytorch_model-1.bin": keys[: len(keys) // 2],
        "pytorch_model-2.bin": keys[len(keys) // 2 :],
    }
    for name, part in shards.items():
        torch.save({k: sd[k] for k in part}, out / name)
    weight_map = {k: name for name, part in shards.items() for k in part}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def test_an_index_giving_a_key_to_the_wrong_file_is_refused_by_name(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path
) -> None:
    d = _saved(tmp_path, max_shard_size="40KB")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key = "model.layers.2.mlp.down_proj.weight"
    other = next(f for f in index["weight_map"].values() if f != index["weight_map"][key])
    index["weight_map"][key] = other
    index_path.write_text(json.dumps(index))
    said = _refused(_on_meta(), d, make_relay_config(disk_dir), disk_dir)
    assert f"the index gives {key!r} to {str(d / other)!r}, which does not hold them" in said


def test_a_torch_state_dict_is_read_mapped(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path
) -> None:
    d = _saved(tmp_path)
    want = train_llama(_whole(d))
    model = offloadd.relay(
        _on_meta(), checkpoint=_as_torch_files(d), config=make_relay_config(disk_dir)
    )
    _trains_as(model, want)


def test_what_cannot_be_read_mapped_is_refused_with_how_to_convert(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path
) -> None:
    d = tmp_path / "pickled"
    d.mkdir()
    legacy = d / "legacy.bin"
    torch.save({"w": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    nested = d / "nested.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, nested)
    cfg = make_relay_config(disk_dir)
    for path, why in (
        (legacy, "without loading it whole"),
        (nested, "not a state dict"),
        (d, "2 torch files"),
        (tmp_path / "nowhere", "does not exist"),
    ):
        with pytest.raises(CheckpointError) as err:
            offloadd.relay(_on_meta(), checkpoint=path, config=cfg)
        said = str(err.value)
        assert str(path) in said and why in said, said
        assert path != legacy or "safe_serialization=True" in said


def test_dtype_without_a_checkpoint_is_refused(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    with pytest.raises(RelayError, match="dtype= converts a checkpoint"):
        offloadd.relay(nn.Linear(2, 2), dtype=torch.float16, config=make_relay_config(disk_dir))


def _fill(mnt: Path, leave: int) -> None:
    """Fill the file system at ``mnt`` but ``leave`` bytes."""
    st = os.statvfs(mnt)
    with open(mnt / "filler", "wb") as f:
        f.truncate(0)
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - leave)


@pytest.mark.parametrize("fs", ["full", "read-only"])
def test_a_store_that_cannot_be_written_is_named_and_left_clean(tmp_path: Path, fs: str) -> None:
    """A full store fails its write (ENOSPC), named; a read-only one is refused by the config
    check of ``ssd_dirs`` inside ``relay()``. Either way before training, nothing left."""
    d = _saved(tmp_path)
    with loop_ext4(tmp_path, 8, reserved=False) as mnt:
        store = mnt / "store"
        store.mkdir()
        if fs == "full":
            _fill(mnt, 200 << 10)  # room for one group of three
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        try:
            with pytest.raises((RelayError, ValueError)) as err:
                offloadd.relay(
                    _on_meta(),
                    checkpoint=d,
                    tier="ssd",
                    ssd_dirs=[str(store)],
                    chunk_bytes=64 << 10,
                )
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        said = str(err.value)
        assert str(store) in said, said
        assert ("No space left" in said) if fs == "full" else ("not writable" in said), said
        assert list(store.iterdir()) == []


def test_from_pretrained_builds_freezes_and_relays_in_one_call(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path
) -> None:
    d = _saved(tmp_path)
    want = train_llama(_whole(d))
    train = ["model.embed_tokens", "model.norm", "lm_head"]  # what _freeze leaves trainable
    model = from_pretrained(d, train=train, config=make_relay_config(disk_dir))
    assert relay_stats(model).groups == 3
    _trains_as(model, want)
    with pytest.raises(RelayError, match=r"train: no parameter is 'head' or in it"):
        from_pretrained(d, train=["head"], config=make_relay_config(disk_dir))
    with pytest.raises(RelayError, match="not a save_pretrained directory"):
        from_pretrained(tmp_path, config=make_relay_config(disk_dir))


def test_from_pretrained_downloads_a_hub_name_to_disk_first(
    make_relay_config: MakeRelayConfig,
    disk_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import huggingface_hub

    d = _saved(tmp_path)
    asked: list[tuple[str, Any]] = []

    def snapshot_download(repo_id: str, allow_patterns: Any = None) -> str:
        asked.append((repo_id, allow_patterns))
        return str(d)  # what the Hub's cache would hold

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = from_pretrained("org/tiny-llama", train=["lm_head"], config=make_relay_config(disk_dir))
    assert asked == [("org/tiny-llama", ["*.json", "*.safetensors"])]
    assert relay_stats(model).groups == 4  # the layers and the embedding: all but the head
    offloadd.unrelay(model)


class _Shared(nn.Module):
    """One frozen weight used by two modules of one layer (a group), and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        a, b = nn.Linear(128, 128, bias=False), nn.Linear(128, 128, bias=False)
        b.weight = a.weight
        self.layers = nn.ModuleList([nn.ModuleDict({"a": a, "b": b})])
        self.head = nn.Linear(128, 2)
        self.layers.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layers[0]
        return self.head(layer["b"](torch.tanh(layer["a"](x))))


def test_a_weight_in_two_modules_of_a_group_stays_one(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_model

    torch.manual_seed(0)
    plain = _Shared()
    save_model(plain, str(tmp_path / "shared.safetensors"))
    with weights_on_meta():
        model = _Shared()
    offloadd.relay(
        model, checkpoint=tmp_path / "shared.safetensors", config=make_relay_config(disk_dir)
    )
    x = torch.randn(3, 128)
    assert same(
        step(plain, x, lambda m, x: m(x).square().mean()),
        step(model, x, lambda m, x: m(x).square().mean()),
    )
    offloadd.unrelay(model)
    layer = model.layers[0]
    assert layer["a"].weight is layer["b"].weight
    assert torch.equal(layer["a"].weight, plain.layers[0]["a"].weight)


def test_dtype_converts_a_model_built_with_real_weights_too(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    d = _saved(tmp_path)
    want = train_llama(_whole(d, dtype=torch.bfloat16), 2)
    real = _freeze(LlamaForCausalLM(_config()))  # float32, real values to be replaced
    model = offloadd.relay(
        real, checkpoint=d, dtype=torch.bfloat16, config=make_relay_config(disk_dir)
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    _trains_as(model, want)


def test_from_pretrained_trains_a_tied_head_by_either_name(
    make_relay_config: MakeRelayConfig, disk_dir: Path, tmp_path: Path
) -> None:
    d = _saved(tmp_path, tied=True)
    model = from_pretrained(d, train=["lm_head"], config=make_relay_config(disk_dir))
    assert model.model.embed_tokens.weight is model.lm_head.weight
    assert model.lm_head.weight.requires_grad
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {"model.embed_tokens.weight"}  # named once: the tie is one tensor
    offloadd.unrelay(model)
    with pytest.raises(RelayError, match=r"no parameter is 'model\.layer' or in it"):
        from_pretrained(d, train=["model.layer"], config=make_relay_config(disk_dir))
