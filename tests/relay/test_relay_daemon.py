"""Relay through a real daemon that is lost, restarted or wedged: between steps, while reads
are in flight, before a load. Every step stays bit-identical to the model without relay (the
lost session's files are read locally, new writes go to the new daemon), and a wedged daemon
is said in the log instead of hanging the run silently."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import offloadd
from offloadd.relay.state import state_of
from offloadd.runtime import stall_watch
from tests._support.daemon_proc import DaemonProc
from tests.relay.cases import Layered, freeze_layers, relay_config, same, square_loss, step

ENGINE_PARAMS = ("default",)  # the daemon does the I/O with its own engine

pytestmark = pytest.mark.filterwarnings("ignore:offloadd. lost the daemon:RuntimeWarning")


def _pair(proc: DaemonProc) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = freeze_layers(Layered(layers=6))
    torch.manual_seed(0)
    cfg = relay_config(proc.dirs[0], daemon={"socket": proc.socket})
    return ref, offloadd.relay(freeze_layers(Layered(layers=6)), config=cfg)


def _lost(model: nn.Module) -> None:
    backend = state_of(model).relay.store.backend
    deadline = time.monotonic() + 10
    while backend.connected:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the client did not notice the daemon's loss"
        time.sleep(0.01)


def _inputs(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=gen) for _ in range(n)]


def test_daemon_lost_between_steps(own_daemon: Callable[..., DaemonProc]) -> None:
    """Killed, then stopped, between steps, a new daemon started each time; then a load
    right after a loss (its write goes to the new daemon) and training on."""
    first = own_daemon().start()
    ref, model = _pair(first)
    current = [first]

    def restart(kill: bool) -> None:
        old = current[0]
        if kill:
            old.kill()
        else:
            assert old.stop() == 0
        _lost(model)
        current[0] = own_daemon(dirs=old.dirs).start()

    for i, x in enumerate(_inputs(6)):
        assert same(step(ref, x, square_loss), step(model, x, square_loss)), i
        if i in (0, 1):
            restart(kill=i == 0)
        if i == 3:
            restart(kill=True)
            new = {k: v * 0.5 for k, v in ref.state_dict().items()}
            ref.load_state_dict(new)
            model.load_state_dict(new)
    assert state_of(model).relay.store.backend.connected  # type: ignore[attr-defined]
    offloadd.unrelay(model)


def _killed_after_a_step(
    own_daemon: Callable[..., DaemonProc], n: int
) -> tuple[DaemonProc, nn.Module, nn.Module, list[torch.Tensor]]:
    """A relayed model and its reference after one step, their daemon killed and its loss
    seen by the client; ``n`` inputs, the first used."""
    proc = own_daemon().start()
    ref, model = _pair(proc)
    xs = _inputs(n)
    assert same(step(ref, xs[0], square_loss), step(model, xs[0], square_loss))
    proc.kill()
    _lost(model)
    return proc, ref, model, xs


def test_a_load_while_the_daemon_is_gone_waits_for_the_next(
    own_daemon: Callable[..., DaemonProc],
) -> None:
    """``load_state_dict`` writes the new weights to the store; the daemon is killed and a new
    one comes up only a moment later (a supervisor's restart). A daemon dying under the write
    itself (the soak's case: ``RelayError: writing the new weights ... failed ([Errno 32] the
    daemon is gone ...)`` out of ``load_state_dict`` at step 1800) fails it with the same EPIPE.
    The write waits for the new daemon, and training goes on, bit-identical, from the loaded
    weights."""
    first, ref, model, xs = _killed_after_a_step(own_daemon, 3)
    later: list[DaemonProc] = []
    timer = threading.Timer(1.0, lambda: later.append(own_daemon(dirs=first.dirs).start()))
    timer.start()
    new = {k: v * 0.5 for k, v in ref.state_dict().items()}
    ref.load_state_dict(new)
    model.load_state_dict(new)
    timer.join()
    assert later and state_of(model).relay.store.backend.connected  # type: ignore[attr-defined]
    for x in xs[1:]:
        assert same(step(ref, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)


def test_a_load_with_no_daemon_back_is_refused_by_name(
    own_daemon: Callable[..., DaemonProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No daemon comes back within the wait: the load raises, naming the weights, the daemon
    and the wait (what it loaded before is loaded, as with any error of load_state_dict); with
    a daemon back, the same load succeeds and training goes on, bit-identical."""
    from offloadd.relay.placeholder import RelayError
    from offloadd.relay.store import WeightStore

    monkeypatch.setattr(WeightStore, "DAEMON_BACK_S", 0.6)
    proc, ref, model, xs = _killed_after_a_step(own_daemon, 2)
    store = state_of(model).relay.store
    before = store.disk_bytes  # type: ignore[union-attr]
    new = {k: v * 0.5 for k, v in ref.state_dict().items()}
    t0 = time.monotonic()
    with pytest.raises(RelayError, match=r"writing the new weights of 'layers\.\d+' failed") as e:
        model.load_state_dict(new)
    waited = time.monotonic() - t0
    assert f"the daemon at {proc.socket} is gone, and none took the write in" in str(e.value)
    assert "keeping in memory" not in str(e.value)
    assert waited < 5  # the load gave up after one wait of 0.6 s
    assert store.disk_bytes == before  # type: ignore[union-attr]  # the failed tries' places
    own_daemon(dirs=proc.dirs).start()
    ref.load_state_dict(new)
    model.load_state_dict(new)
    assert same(step(ref, xs[1], square_loss), step(model, xs[1], square_loss))
    offloadd.unrelay(model)


def test_daemon_killed_while_reads_are_in_flight(
    own_daemon: Callable[..., DaemonProc],
) -> None:
    """The daemon dies in a layer's forward (the next layers' reads queued or in flight) and in
    backward; no daemon is started again: the reads finish from the lost session's files."""
    proc = own_daemon().start()
    ref, model = _pair(proc)
    xs = _inputs(4)
    assert same(step(ref, xs[0], square_loss), step(model, xs[0], square_loss))

    def kill_once(*args: object) -> None:
        handle.remove()
        proc.kill()
        _lost(model)

    handle = model.layers[2].register_forward_pre_hook(kill_once)
    assert same(step(ref, xs[1], square_loss), step(model, xs[1], square_loss))
    for x in xs[2:]:
        assert same(step(ref, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)


def test_wedged_daemon_is_said(
    own_daemon: Callable[..., DaemonProc],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stopped (SIGSTOP) daemon holds relay's reads: the wait is logged, naming the weights
    and the daemon, and training goes on, bit-identical, once it resumes."""
    monkeypatch.setattr(stall_watch, "STALL_WARN_S", 0.3)
    proc = own_daemon().start()
    ref, model = _pair(proc)
    xs = _inputs(3)
    assert same(step(ref, xs[0], square_loss), step(model, xs[0], square_loss))

    def wedge(*args: object) -> None:
        handle.remove()
        proc.pause()
        threading.Timer(1.5, proc.resume).start()

    handle = model.layers[1].register_forward_pre_hook(wedge)
    with caplog.at_level("WARNING", logger="offloadd"):
        assert same(step(ref, xs[1], square_loss), step(model, xs[1], square_loss))
    said = [
        r.getMessage() for r in caplog.records if "relay's read of the weights" in r.getMessage()
    ]
    assert said and proc.socket in said[0], caplog.text
    assert same(step(ref, xs[2], square_loss), step(model, xs[2], square_loss))
    offloadd.unrelay(model)


def test_daemon_dirs_left_clean(own_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    """Unrelay through a daemon gives its files back: own_daemon checks nothing is left."""
    proc = own_daemon().start()
    ref, model = _pair(proc)
    x = _inputs(1)[0]
    assert same(step(ref, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)
    assert not proc.wait_idle()["sessions"]


def test_wedged_daemon_holding_a_write_is_said(
    own_daemon: Callable[..., DaemonProc],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A load writes the group again: a daemon stopped under that write is said as holding
    relay's write, not a read, and the load goes through once it resumes."""
    monkeypatch.setattr(stall_watch, "STALL_WARN_S", 0.3)
    proc = own_daemon().start()
    ref, model = _pair(proc)
    with torch.no_grad():
        ref.layers[2][1].weight.add_(1.0)

    def wedge(*args: object) -> None:  # after relay's pre-hook read the group in
        proc.pause()
        threading.Timer(1.5, proc.resume).start()

    model.layers[2].register_load_state_dict_pre_hook(wedge)
    with caplog.at_level("WARNING", logger="offloadd"):
        model.load_state_dict(ref.state_dict())
    said = [
        r.getMessage() for r in caplog.records if "relay's write of the weights" in r.getMessage()
    ]
    assert said and "'layers.2'" in said[0] and proc.socket in said[0], caplog.text
    assert not [r for r in caplog.records if "relay's read" in r.getMessage()], caplog.text
    assert same(step(ref, _inputs(1)[0], square_loss), step(model, _inputs(1)[0], square_loss))
    offloadd.unrelay(model)
