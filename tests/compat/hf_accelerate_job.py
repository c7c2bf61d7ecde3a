"""The torch 2.10 compat row's job (noxfile compat-torch2.10, LOONGKIT_HF_ACC_COMPILE): a plain Hugging
Face Accelerate training loop on a tiny Llama built in code (sdpa attention, CPU), as a user writes it:
`Accelerator()`, `prepare(model, optimizer)`, a few steps. The user asks for no compilation; under
LOONGKIT_HF_ACC_COMPILE=1 loongkit makes `prepare()` compile the model with inductor.

Prints `prepare() compiled the model: True|False` and the losses, and writes them as JSON to the path
in argv[1] (the session compares the bare and the loongkit run).
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

STEPS = 6


def main() -> None:
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    compiled = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    generator = torch.Generator().manual_seed(1)
    losses = []
    model.train()
    for _ in range(STEPS):
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=generator)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    print(f"prepare() compiled the model: {compiled}; torch {torch.__version__}; losses "
          + " ".join(f"{v:.6f}" for v in losses), flush=True)
    with open(sys.argv[1], "w") as fh:
        json.dump({"compiled": compiled, "losses": losses, "torch": torch.__version__}, fh)


if __name__ == "__main__":
    main()
