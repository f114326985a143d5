"""Hugging Face transformers clients that never import offloadd: GPT-2, BERT and T5 built from
configs with random weights (no downloads), trained by a custom loop or by transformers.Trainer.

Usage: hf_train.py loop|trainer OUTPUT_DIR. Prints one JSON line {model: {losses, weights}}.
"""

import hashlib
import json
import sys

import torch
import transformers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainingArguments,
)

VOCAB, SEQ, BATCH = 128, 32, 4


def build(name):
    if name == "gpt2":
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=64,
            n_layer=2,
            n_head=2,
            bos_token_id=1,
            eos_token_id=2,
        )
        return GPT2LMHeadModel(cfg)
    if name == "bert":
        cfg = BertConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=SEQ,
        )
        return BertForMaskedLM(cfg)
    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_ff=128,
        d_kv=32,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(cfg)


def sample(name, gen):
    ids = torch.randint(1, VOCAB, (SEQ,), generator=gen)
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (SEQ // 2,), generator=gen)}
    return {"input_ids": ids, "labels": ids.clone()}


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def custom_loop(name):
    torch.manual_seed(0)
    model = build(name)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        micro = []
        for _ in range(2):  # gradient accumulation: both forwards, then both backwards
            batch = [sample(name, gen) for _ in range(BATCH)]
            inputs = {k: torch.stack([b[k] for b in batch]) for k in batch[0]}
            micro.append(model(**inputs).loss / 2)
        for loss in micro:
            loss.backward()
        losses.append(sum(m.item() for m in micro))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "weights": digest(model)}


def with_trainer(name, out_dir):
    transformers.set_seed(0)
    model = build(name)
    gen = torch.Generator().manual_seed(1)
    data = [sample(name, gen) for _ in range(4 * BATCH)]
    args = TrainingArguments(
        output_dir=f"{out_dir}/{name}",
        max_steps=2,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"losses": losses, "weights": digest(model)}


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    result = {}
    for name in ("gpt2", "bert", "t5"):
        result[name] = custom_loop(name) if mode == "loop" else with_trainer(name, out_dir)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
