"""A tiny Llama (built in code, no weights, no hub) fine-tuned through HuggingFace Accelerate.

The model is a ``LlamaForCausalLM`` from a ``LlamaConfig`` written here; the data are synthetic
token sequences (arithmetic progressions modulo the vocabulary, so the next token is learnable and
the loss really falls) served by a DataLoader that Accelerate prepares. Nothing in it knows about
loongkit; it prints ``step N loss: ... time: ... data_time: ...`` for every step.

    python examples/hf_llama/train.py --steps 30
    LOONGKIT_ALL=1 loongkit-run python examples/hf_llama/train.py
    loongkit compare -- python examples/hf_llama/train.py
    accelerate launch --num_processes 2 examples/hf_llama/train.py     # or torchrun --nproc-per-node 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# No network: the config is built in code and nothing is downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch.utils.data import DataLoader, Dataset


class Progressions(Dataset):
    """Sequence i: start, start+step, start+2*step, ... (mod vocab), with a per-sequence step."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(vocab, (n,), generator=g)
        self.steps = torch.randint(1, 8, (n,), generator=g)
        self.seq_len, self.vocab = seq_len, vocab

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = (self.starts[index] + self.steps[index] * torch.arange(self.seq_len)) % self.vocab
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

    accelerator = Accelerator(mixed_precision="no")
    set_seed(args.seed)
    vocab = 512
    config = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(256, args.seq_len), tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    dataset = Progressions(args.steps * args.batch_size * accelerator.num_processes, args.seq_len, vocab, args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=5, num_training_steps=args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    model.train()
    times: list[float] = []
    start = time.perf_counter()
    for step, batch in enumerate(loader):
        data_time = time.perf_counter() - start
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        times.append(now - start)
        start = now
        if accelerator.is_main_process:
            print(f"step {step:4d} loss: {loss.item():.7f} time: {times[-1]:.4f} data_time: {data_time:.4f}",
                  flush=True)
        if step + 1 >= args.steps:
            break
    if accelerator.is_main_process:
        warm = times[len(times) // 5:] or times
        # (no loss on this line: log parsers such as `loongkit compare` would count it as a step)
        print(f"done: {len(times)} steps, median step {statistics.median(warm) * 1000:.1f} ms")
    accelerator.end_training()


if __name__ == "__main__":
    main()
