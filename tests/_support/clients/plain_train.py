"""A plain PyTorch training script that never imports offloadd (a client of OFFLOADD=1).

Prints one JSON line: the losses and a SHA-256 of the final weights. Exercises gradient
accumulation (two forwards before their backwards), a loss module called outside the model,
an eval forward under no_grad and a torch.func call, all of which must stay untouched.
"""

import hashlib
import json
import sys

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 128)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(128, 4, 256, dropout=0.1, batch_first=True) for _ in range(2)
        )
        self.head = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.manual_seed(0)
    model = Net()
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        # gradient accumulation: two forwards, then their backwards in reverse order
        xs = [torch.randint(0, 64, (4, 64), generator=gen) for _ in range(2)]
        outs = [loss_fn(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()) / 2 for x in xs]
        for loss in reversed(outs):
            loss.backward()
        losses.append(sum(o.item() for o in outs))
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            model(xs[0])
        model.train()
        # torch.func refuses saved-tensor hooks: offloadd must stay out of it.
        bias = model.head.bias.detach()

        def head_sum(w: torch.Tensor, bias: torch.Tensor = bias) -> torch.Tensor:
            return torch.func.functional_call(
                model.head, {"weight": w, "bias": bias}, (torch.ones(2, 128),)
            ).sum()

        g = torch.func.grad(head_sum)(model.head.weight.detach())
        assert g.shape == model.head.weight.shape
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    print(json.dumps({"losses": losses, "weights": digest.hexdigest()}))


if __name__ == "__main__":
    main()
