"""offloadd.relay with the rest of offloadd and with what users combine it with: activation
offload, memsave, torch.compile, PEFT LoRA, and ``OFFLOADD_RELAY=frozen`` in an unmodified
script. Every combination is bit-identical to the same model without relay."""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import offloadd
from offloadd.auto import InfeasibleBudget
from offloadd.config import Config
from offloadd.runtime.compiled import unseen
from tests._support.envrun import (
    CLIENTS,
    PYTHON,
    RANKS,
    clean_env,
    last_json,
    offload_env,
    run,
    torchrun,
)
from tests._support.helpers import MakeOffloader
from tests.relay.cases import (
    Convs,
    Layered,
    MakeRelayConfig,
    freeze_layers,
    llama,
    llama_loss,
    same,
    square_loss,
    step,
)


def test_with_activation_offload(
    make_offloader: MakeOffloader, make_relay_config: MakeRelayConfig, disk_dir: Path, backend: str
) -> None:
    """Relay's saved-tensor hook sits above the Offloader's: weights become refs, every other
    saved tensor goes on to the Offloader, which moves as much as without relay."""
    x = torch.randn(6, 16)
    torch.manual_seed(0)
    ref = freeze_layers(Layered())
    plain = make_offloader(disk_dir)
    with plain:
        loss = square_loss(ref, x)
    loss.backward()
    want_moved = plain.stats().offloaded_bytes
    plain.close()
    torch.manual_seed(0)
    want = step(freeze_layers(Layered()), x, square_loss)

    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    off = make_offloader(disk_dir)
    for _ in range(2):
        assert same(want, step(model, x, square_loss, off))
    assert off.stats().offloaded_bytes == 2 * want_moved
    off.close()
    offloadd.unrelay(model)


def test_with_memsave(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    x = torch.randn(2, 3, 12, 12)
    torch.manual_seed(0)
    want = step(Convs(), x, square_loss)
    torch.manual_seed(0)
    model = offloadd.relay(offloadd.memsave(Convs()), config=make_relay_config(disk_dir))
    assert type(model.trunk[0]).__name__ == "MemsaveConv2d"
    for _ in range(2):
        assert same(want, step(model, x, square_loss))
    offloadd.unrelay(model)


def test_compiled(
    make_relay_config: MakeRelayConfig, disk_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under torch.compile, relay's hooks run eagerly: a graph break at each group's forward.
    The same model compiled with a no-op hook at the same places computes the same bits, and
    relay says once that the kernels are not those of the model compiled whole."""
    noop = unseen(lambda *args: None)

    def reference() -> nn.Module:
        torch.manual_seed(0)
        m = freeze_layers(Layered())
        m.register_forward_pre_hook(noop)
        for layer in m.layers:
            layer.register_forward_pre_hook(noop)
            layer.register_forward_hook(noop, always_call=True)
        return m

    xs = [torch.randn(6, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref = torch.compile(reference())
    want = [step(ref, x, square_loss) for x in xs]
    torch.manual_seed(0)
    model = torch.compile(
        offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    )
    with caplog.at_level(logging.WARNING, logger="offloadd"):
        for x, w in zip(xs, want, strict=True):
            assert same(w, step(model, x, square_loss))
    said = [r.getMessage() for r in caplog.records if "compiled whole" in r.getMessage()]
    assert len(said) == 1 and "layer.compile()" in said[0], said
    offloadd.unrelay(model._orig_mod)  # type: ignore[arg-type]


def test_relaying_the_compiled_wrapper_warns_at_once(
    make_relay_config: MakeRelayConfig, disk_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``relay(torch.compile(model))``, as ``OFFLOADD_RELAY=frozen`` does for a script that
    compiles its model whole: the wrapper's hooks run outside the compiled frame, where the
    warning above never came; it comes at relay, naming the model's class."""
    compiled = torch.compile(freeze_layers(Layered()))
    with caplog.at_level(logging.WARNING, logger="offloadd"):
        offloadd.relay(compiled, config=make_relay_config(disk_dir))
    said = [r.getMessage() for r in caplog.records if "compiled whole" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("offloadd relay: Layered is compiled whole")
    offloadd.unrelay(compiled)


def test_layers_compiled_on_their_own(
    make_relay_config: MakeRelayConfig, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``layer.compile()``, what relay tells a user who compiles the model whole: the same bits
    as the layers compiled with no-op hooks, and no warning from dynamo. Its frame callback used
    to catch the frame of relay's hook wrapper (``unseen``) at the graph break and warn that it
    cannot trace ``set_eval_frame``."""
    import torch._dynamo.utils

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())  # warned once a process
    noop = unseen(lambda *args: None)
    torch.manual_seed(0)
    ref = freeze_layers(Layered(layers=2))
    for layer in ref.layers:
        layer.register_forward_pre_hook(noop)
        layer.register_forward_hook(noop, always_call=True)
        layer.compile(backend="aot_eager")  # dynamo is what warned: no kernels to build
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered(layers=2)), config=make_relay_config(disk_dir))
    for layer in model.layers:
        layer.compile(backend="aot_eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(2):  # compiled, then run compiled
            x = torch.randn(6, 16, generator=torch.Generator().manual_seed(i))
            assert same(step(ref, x, square_loss), step(model, x, square_loss))
    dynamo = [str(w.message) for w in seen if "set_eval_frame" in str(w.message)]
    assert not dynamo, dynamo
    offloadd.unrelay(model)


def test_lora(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    """A PEFT LoRA model: the base weights PEFT froze are relayed; the adapters train."""
    peft = pytest.importorskip("peft")
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))

    def lora() -> nn.Module:
        torch.manual_seed(0)
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(llama(), cfg)

    want = step(lora(), ids, llama_loss)
    model = offloadd.relay(lora(), config=make_relay_config(disk_dir))
    st = offloadd.relay_stats(model)
    assert st.groups >= 3
    assert (
        type(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight).__name__
        == "RelayedWeight"
    )
    got = step(model, ids, llama_loss)
    assert same(want, got)
    assert any("lora_A" in k for k in got[1])
    offloadd.unrelay(model)


def test_budget_counts_relayed_weights(
    make_offloader: MakeOffloader, make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """On CPU the planner leaves room in the budget for what relay holds (its slabs' peak)."""
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered(layers=6)), config=make_relay_config(disk_dir))
    budget = 8 << 20
    off = make_offloader(disk_dir, budget=budget)
    torch.manual_seed(0)
    ref = freeze_layers(Layered(layers=6))
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = torch.randn(32, 16, generator=gen)
        assert same(step(ref, x, square_loss), step(model, x, square_loss, off))
    plan = off.plan()
    assert plan is not None
    held = offloadd.relay_stats(model).peak_resident_bytes
    assert held > 0 and plan.budget <= budget - held
    off.close()
    offloadd.unrelay(model)


def test_a_fraction_of_keeps_peak_counts_relayed_weights(
    make_offloader: MakeOffloader, make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """A fraction budget is of keep's peak with relay's slabs in it: ``1.0x`` keeps every block
    (it was refused as a budget of 0 bytes, the slabs taken from the activations' keep peak),
    and a refused fraction names what relay holds, in the user's terms. (A batch of 512: the
    host cache, which measures the peaks, counts allocations of 128 KiB and more.)"""
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered(layers=6)), config=make_relay_config(disk_dir))
    off = make_offloader(disk_dir, budget="1.0x", min_bytes=1024)
    for _ in range(4):
        step(model, torch.randn(512, 16), square_loss, off)
    plan = off.plan()
    assert plan is not None and set(plan.decisions) == {"keep"}
    off.close()
    off = make_offloader(disk_dir, budget="0.2x", min_bytes=1024)
    held = offloadd.relay_stats(model).peak_resident_bytes
    with pytest.raises(InfeasibleBudget) as refused:
        for _ in range(6):
            step(model, torch.randn(512, 16), square_loss, off)
    assert f"both count the {held} bytes" in str(refused.value), refused.value
    assert refused.value.smallest > held and refused.value.budget < refused.value.smallest
    off.close()
    offloadd.unrelay(model)


def test_relay_key() -> None:
    assert Config().relay == "off" and Config().relay_window == 2
    assert (
        Config.from_env({"OFFLOADD_RELAY": "frozen", "OFFLOADD_RELAY_WINDOW": "3"}).relay_window
        == 3
    )
    with pytest.raises(ValueError, match="relay"):
        Config.from_env({"OFFLOADD_RELAY": "weights"})
    with pytest.raises(ValueError, match="relay_window"):
        Config.from_env({"OFFLOADD_RELAY_WINDOW": "0"})


@pytest.mark.parametrize("model", ["stack", "nested"])
def test_env_var_relay_is_identical(model: str, disk_dir: Path, tmp_path: Path) -> None:
    """``nested``: relayed from within the model's own first call, whose module hooks torch had
    gathered before relay's were registered (its first forward raised a RelayError)."""
    cmd = [PYTHON, str(CLIENTS / "relay_train.py"), "3", model]
    base = last_json(run(cmd, clean_env()).stdout)
    assert base["frozen_weight"] == "Parameter"
    env = offload_env(disk_dir, tmp_path / "report.json", OFFLOADD_RELAY="frozen")
    proc = run(cmd, env)
    got = last_json(proc.stdout)
    assert (got["losses"], got["weights"]) == (base["losses"], base["weights"])
    assert got["frozen_weight"] == "RelayedWeight"
    if model == "nested":
        assert "; relayed 1.5 MiB of frozen weights in" in proc.stderr, proc.stderr
        return
    # the exit summary and the report say what relay moved: 6 layers of 2 x 256 x 512 fp32
    frozen = 6 * (2 * 256 * 512 + 512 + 256) * 4
    assert "; relayed 6.0 MiB of frozen weights in 6 groups, peak held" in proc.stderr
    (relayed,) = json.loads((tmp_path / "report.json").read_text())["relay"]
    assert relayed["groups"] == 6 and relayed["relayed_bytes"] >= frozen
    assert relayed["read_bytes"] >= (2 * 6 - 2) * 2 * relayed["relayed_bytes"] // 6 // 2


def test_env_var_relay_under_torchrun_ddp(disk_dir: Path, tmp_path: Path) -> None:
    """Two gloo ranks, DistributedDataParallel around the model, OFFLOADD_RELAY=frozen in the
    unmodified script: each rank's losses and final weights are the ones without offloadd."""

    def launch(env: dict[str, str], out: Path) -> dict[str, dict[str, object]]:
        out.mkdir()
        env["CLIENT_OUT"] = str(out)

        def clear() -> None:
            for p in out.iterdir():
                p.unlink()

        torchrun([str(CLIENTS / "relay_train.py"), "3"], env, 300, before_retry=clear)
        return {p.name: json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))}

    base = launch(clean_env(), tmp_path / "base")
    env = offload_env(disk_dir, tmp_path / "report-{rank}.json", OFFLOADD_RELAY="frozen")
    got = launch(env, tmp_path / "relay")
    assert set(got) == set(base) == {"rank-0.json", "rank-1.json"}
    for rank, want in base.items():
        assert want["frozen_weight"] == "Parameter"
        assert got[rank]["frozen_weight"] == "RelayedWeight", rank
        assert (got[rank]["losses"], got[rank]["weights"]) == (want["losses"], want["weights"])


def test_ddp_broadcast_reaches_relayed_weights(tmp_path: Path) -> None:
    """DDP's first broadcast makes every rank's weights rank 0's. Wrapped within resident(), a
    relayed model trains bit-identically to the same DDP without relay on each rank, its frozen
    weights included, though the ranks' frozen weights started different; wrapped outside it,
    the broadcast raises instead of skipping the relayed weights."""

    def clear() -> None:
        shutil.rmtree(tmp_path / "relay", ignore_errors=True)

    cmd = [str(RANKS / "relay_ddp.py"), str(tmp_path / "relay")]
    torchrun(cmd, clean_env(), 300, before_retry=clear)
    ranks = [json.loads(p.read_text()) for p in sorted((tmp_path / "relay").glob("rank-*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["relay"] == r["plain"], r["rank"]
        assert r["plain"]["weights"] == ranks[0]["plain"]["weights"]  # synced: rank 0's
        assert "DistributedDataParallel" in r["relay_first"] and "resident" in r["relay_first"]


_TWO_MODELS = """
import gc
import sys

sys.path.insert(0, {root!r})  # this checkout's offloadd, imported with torch (OFFLOADD=1)
import torch
from torch import nn

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(3))
        self.layers.requires_grad_(False)
        self.head = nn.Linear(256, 4)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)

first, second = Stack(), Stack()
for m in (first, second):
    m(torch.randn(8, 256)).square().mean().backward()
del first, m
gc.collect()
import offloadd
offloadd.unrelay(second)  # alive at exit, unrelayed
print(type(second.layers[0].weight).__name__)
"""


def test_exit_report_counts_dropped_and_unrelayed_models(disk_dir: Path, tmp_path: Path) -> None:
    """OFFLOADD_RELAY=frozen relays each model the script calls; the exit report has what each
    relay moved: a model dropped before exit, and one the script unrelayed and kept."""
    script = tmp_path / "two_models.py"
    script.write_text(_TWO_MODELS.format(root=str(Path(__file__).resolve().parents[2])))
    env = offload_env(disk_dir, tmp_path / "report.json", OFFLOADD_RELAY="frozen")
    proc = run([PYTHON, str(script)], env)
    assert proc.stdout.split() == ["Parameter"]
    relayed = json.loads((tmp_path / "report.json").read_text())["relay"]
    assert [r["groups"] for r in relayed] == [3, 3], relayed
    assert "; relayed 1.5 MiB of frozen weights in 6 groups" in proc.stderr, proc.stderr
