"""A Megatron-core client that never imports offloadd: GPTModel with the local (non-Transformer-
Engine) layer spec, a few Adam steps on one GPU, started by torchrun --nproc_per_node=1.

Megatron's attention asks for CUDA, so this runs where a GPU is. Its global memory buffer hands
out the same storage again outside autograd: the in-place/version protection of offloadd must
either give the value at save time or raise, never a wrong gradient. Prints one JSON line:
losses and a digest of the final weights.
"""

import hashlib
import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, BATCH = 256, 64, 4


def main():
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True, warn_only=True)  # the test also checks run-to-run
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        deterministic_mode=True,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    ).to(device)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0).expand(BATCH, -1)
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool, device=device))
    attention_mask = (~mask).unsqueeze(0).unsqueeze(0)  # True = masked out
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device)
        per_token = model(
            tokens[:, :-1], position_ids, attention_mask, labels=tokens[:, 1:].contiguous()
        )
        loss = per_token.float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.cuda.synchronize()
    w = hashlib.sha256()
    for p in model.parameters():
        w.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    print(json.dumps({"losses": losses, "weights": w.hexdigest()}), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
