"""Train your own model: a Hugging Face config and a token file -> a plan under a memory cap -> training
with validation -> export -> `from_pretrained` -> a generated line (the README's "Train your own model").

    torchrun --standalone --nproc_per_node=2 examples/train_your_own.py

Run it from a scratch directory: it writes train.bin, val.bin and my-gpt/ there. The text is Python's own
`argparse.py` as bytes (vocabulary 256: nothing is downloaded). Without torchrun every stage runs in this
process. The code below is the README's snippet, line for line (tests/integration/test_demo_lm.py checks).
"""

import argparse, inspect, os
import numpy as np, torch, torch.distributed as dist, transformers
from torch.utils.data import TensorDataset
from model_parallel import PipelineTrainer, RunOptions, TrainConfig
from model_parallel.fileio import atomic_write

if "RANK" in os.environ: dist.init_process_group("gloo")  # torchrun: a stage per process (else all in this one)
text = np.frombuffer(inspect.getsource(argparse).encode(), np.uint8).astype(np.uint16)  # real text, byte tokens
atomic_write("train.bin", text[:-8192].tofile, binary=True); atomic_write("val.bin", text[-8192:].tofile, binary=True)

def windows(path, T=64):  # a nanoGPT-style token file -> T-token inputs and their next-token targets
    ids = torch.from_numpy(np.fromfile(path, np.uint16).astype(np.int64)).unfold(0, T + 1, T)
    return TensorDataset(ids[:, :-1], ids[:, 1:])

torch.manual_seed(0)  # every rank builds the same initial weights
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
    n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=10, eos_token_id=10))  # b"\n" ends a line
val_data = windows("val.bin")
trainer = PipelineTrainer(model, lambda p: torch.optim.AdamW(p, lr=3e-3), windows("train.bin"),
                          TrainConfig(batch_size=16, num_microbatches=4), eval_data=val_data,
                          memory_per_worker=100e6, options=RunOptions(eval_every=50, eval_steps=4))
val = [trainer.evaluate(val_data, 4).loss] + [r.extra["val_loss"] for r in trainer.train(200) if "val_loss" in r.extra]
if (out := trainer.save_pretrained("my-gpt")) is not None:  # each rank writes its stage's shards; rank 0 gets the dir
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = model.generate(torch.tensor([list(b"def parse_args(")]), max_new_tokens=40, do_sample=False)
    print(f"validation loss {val[0]:.3f} -> {val[-1]:.3f}:", bytes(ids[0].tolist()).decode(errors="replace"))
trainer.close()
if dist.is_initialized(): dist.destroy_process_group()  # torch's shutdown (gloo may abort at exit without)
