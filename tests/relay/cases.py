"""Models with frozen weights, and one training step, for the relay tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offloadd import Offloader
from offloadd.config import Config

Step = tuple[torch.Tensor, dict[str, torch.Tensor]]


#: The ``make_relay_config`` fixture (tests/relay/conftest.py): :func:`relay_config` with the
#: test's engine and backend options, which the call's own options override.
MakeRelayConfig = Callable[..., Config]


def relay_config(disk_dir: Path, **kw: Any) -> Config:
    """The store in ``disk_dir`` (on the default engine unless ``kw`` names one), with chunks
    small enough that a layer spans several."""
    opts: dict[str, Any] = dict(
        tier="ssd", ssd_dirs=(str(disk_dir),), chunk_bytes=64 << 10, io_threads=2
    )
    opts.update(kw)
    opts.pop("io_engine", None)
    return Config().replace(**opts)


class Layered(nn.Module):
    """A residual stack in a ModuleList (one relay group per layer), a trainable head."""

    def __init__(self, layers: int = 4, d: int = 128, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d, dtype=dtype)
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(d, dtype=dtype),
                nn.Linear(d, 3 * d, dtype=dtype),
                nn.GELU(),
                nn.Linear(3 * d, d, dtype=dtype),
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(d, 4, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def freeze_layers(model: nn.Module) -> nn.Module:
    for layer in model.layers:  # type: ignore[union-attr]
        layer.requires_grad_(False)
    return model


class Strided(nn.Module):
    """Frozen weights that are views: a transposed one, two sharing one storage at offsets."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(160, 96)
        self.wt = nn.Parameter(base.t(), requires_grad=False)  # (96, 160), strides (1, 96)
        flat = torch.randn(2 * 96 * 96 + 7)
        self.a = nn.Parameter(flat[7 : 7 + 96 * 96].view(96, 96), requires_grad=False)
        self.b = nn.Parameter(flat[7 + 96 * 96 :].view(96, 96), requires_grad=False)
        self.out = nn.Linear(160, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(torch.tanh(x @ self.a) @ self.b) @ self.wt)


class Convs(nn.Module):
    """A frozen convolutional trunk (no ModuleList: one group per module)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.ReLU(),
        ).requires_grad_(False)
        self.head = nn.Linear(128, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x).mean((2, 3)))


def llama(layers: int = 3, *, tied: bool = False) -> nn.Module:
    """A small HF Llama whose decoder layers' Linear weights are frozen."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=172,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        vocab_size=512,
        tie_word_embeddings=tied,
    )
    m = LlamaForCausalLM(cfg)
    for layer in m.model.layers:
        for sub in layer.modules():
            if isinstance(sub, nn.Linear):
                sub.requires_grad_(False)
    if tied:
        m.model.embed_tokens.requires_grad_(False)
    return m


def llama_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(input_ids=x, labels=x).loss  # type: ignore[no-any-return]


def step(
    model: nn.Module,
    x: torch.Tensor,
    loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    off: Offloader | None = None,
) -> Step:
    """One forward (in ``off``'s scope if given) and backward: the loss and every gradient (the
    input's too if it has one)."""
    model.zero_grad(set_to_none=True)
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    with off if off is not None else contextlib.nullcontext():
        loss = loss_of(model, x)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if x.grad is not None:
        grads["<input>"] = x.grad.clone()
    return loss.detach(), grads


def train_llama(model: nn.Module, steps: int = 3) -> list[Step]:
    """Steps of :func:`llama_loss` with AdamW on what requires grad (the trained part changes
    between them): each step's loss and gradients."""
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = []
    for _ in range(steps):
        out.append(step(model, ids, llama_loss))
        opt.step()
    return out


def same(a: Step, b: Step) -> bool:
    return (
        torch.equal(a[0], b[0])
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    )


def square_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).float().square().mean()


Case = tuple[Callable[[], nn.Module], Callable[[torch.Generator], torch.Tensor], object]
# model, input from a generator, loss: the shapes relay is checked on
CASES: dict[str, Case] = {
    "layered": (
        lambda: freeze_layers(Layered()),
        lambda g: torch.randn(6, 16, generator=g),
        square_loss,
    ),
    "layered-bf16": (
        lambda: freeze_layers(Layered(dtype=torch.bfloat16)),
        lambda g: torch.randn(6, 16, generator=g).bfloat16(),
        square_loss,
    ),
    "strided-views": (Strided, lambda g: torch.randn(5, 96, generator=g), square_loss),
    "convs": (Convs, lambda g: torch.randn(2, 3, 12, 12, generator=g), square_loss),
    "hf-llama": (llama, lambda g: torch.randint(0, 512, (2, 12), generator=g), llama_loss),
}


def build(case: str, cases: dict[str, Case] = CASES, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return cases[case][0]().to(device)


def train(
    model: nn.Module, case: str, steps: int = 3, cases: dict[str, Case] = CASES, device: str = "cpu"
) -> list[object]:
    """``steps`` SGD steps on the trainable parameters; each step's loss and gradients (inputs
    drawn on the CPU, the same on every device)."""
    _, make_input, loss_of = cases[case]
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    out = []
    for _ in range(steps):
        out.append(step(model, make_input(g).to(device), loss_of))  # type: ignore[arg-type]
        opt.step()
    if device != "cpu":
        torch.cuda.synchronize()
    return out
