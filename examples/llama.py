"""A Hugging Face model made fault-tolerant with hpcft: transformers' LlamaForCausalLM, built from a small LlamaConfig
with random weights (nothing is downloaded), trained data parallel on synthetic tokens with AdamW.

  python examples/llama.py                                  # a laptop: one process, CPU
  hpcft run --spares 1 -- python examples/llama.py          # inside a Slurm allocation, one rank per task
  sbatch examples/frontier/llama.sbatch                     # Frontier (see examples/README.md)

Needs transformers (`pip install 'hpcft[examples]'`). The gradients are averaged one all-reduce per parameter, so a
resumed run equals an uninterrupted one bit for bit; wrap the model in DDP or fully_shard as ddp.py and fsdp2.py do.
"""
import sys

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:
    sys.exit("examples/llama.py needs Hugging Face transformers: pip install 'hpcft[examples]'")

import torch

import common
import hpcft


def main() -> int:
    args = common.parser(__doc__).parse_args()

    ctx = hpcft.init()                                  # rank, world, device and process groups from the launcher
    common.setup(args, ctx)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=4 * args.width,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq, use_cache=False)
    torch.manual_seed(args.seed)                        # the same random weights on every rank
    model = LlamaForCausalLM(config).to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    seen = {"samples": 0}                               # the data position, recorded with every snapshot
    ckpt = hpcft.Checkpointer(model, optimizer, hpcft.Options(every=args.every, job_id=common.job_id(ctx, "llama")),
                              extra=lambda: dict(seen), dp_group=ctx.dp_group)
    start = ckpt.restore()                              # the steps already done: 0 on a fresh run
    seen.update(ckpt.extra or {})

    for step in range(start, args.steps):
        inputs, targets = common.batch(args, step, ctx.dp_rank, ctx.device)
        loss = common.lm_loss(model(input_ids=inputs).logits, targets)
        optimizer.zero_grad()
        loss.backward()
        common.average_gradients(model, ctx.dp_group)
        seen["samples"] += len(inputs) * ctx.dp
        optimizer.step()                                # hpcft snapshots in the optimizer's post-step hook
        common.after_step(args, ctx, step, loss)
    return common.finish(args, ctx, ckpt, model, optimizer, seen)


if __name__ == "__main__":
    sys.exit(main())
