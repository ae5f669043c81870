"""Tensor-parallel decoding on CPUs: a bf16 decoder stack split over the ranks
of one host, as CPU LLM serving runs it (Megatron-style: q, k, v, gate and up
split by columns, o and down by rows, one all-reduce after each of those),
with the all-reduce swapped between backends.

    .venv/bin/torchrun --nproc_per_node=2 examples/tp_inference.py [--hidden 2048] [--layers 4] [--tokens 32]

For each of gloo, collx, collx under torch.compile (the whole decode step
compiled, its all-reduces in the graph) and DeepSpeed's shared-memory
all-reduce (deepspeed.comm.inference_all_reduce, where deepspeed is installed:
`make bench-setup`), in turns: greedy decoding of --tokens tokens after a
short prompt, with a KV cache. It prints decode tokens/s (the slowest rank's),
the time of one all-reduce of a token's activation (1 x hidden bf16) in a
loop of its own, and whether the tokens match gloo's.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))  # DeepSpeed's op needs it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Layer(torch.nn.Module):
    """One decoder layer's shard on this rank: heads/tp heads, ffn/tp of the MLP."""

    def __init__(self, hidden, heads, ffn, tp, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        rank = dist.get_rank()

        def shard(rows, cols, dim):
            full = torch.randn(rows, cols, generator=g) / cols ** 0.5
            return full.chunk(tp, dim)[rank].to(torch.bfloat16).contiguous()

        self.head_dim, self.local_heads = hidden // heads, heads // tp
        self.wqkv = torch.cat([shard(hidden, hidden, 0) for _ in range(3)])
        self.wo = shard(hidden, hidden, 1)
        self.wgate, self.wup = shard(ffn, hidden, 0), shard(ffn, hidden, 0)
        self.wdown = shard(hidden, ffn, 1)

    def forward(self, x, cache, pos, all_reduce):
        b, s, _ = x.shape
        q, k, v = F.linear(F.rms_norm(x, x.shape[-1:]), self.wqkv).chunk(3, -1)
        q, k, v = (t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        cache[0][:, :, pos:pos + s], cache[1][:, :, pos:pos + s] = k, v
        keys, values = cache[0][:, :, :pos + s], cache[1][:, :, :pos + s]
        y = F.scaled_dot_product_attention(q, keys, values, is_causal=s > 1)
        x = x + all_reduce(F.linear(y.transpose(1, 2).reshape(b, s, -1), self.wo))
        h = F.rms_norm(x, x.shape[-1:])
        return x + all_reduce(F.linear(F.silu(F.linear(h, self.wgate)) * F.linear(h, self.wup), self.wdown))


class Model(torch.nn.Module):
    def __init__(self, args, tp):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = (torch.randn(args.vocab, args.hidden, generator=g) / 4).to(torch.bfloat16)
        self.layers = torch.nn.ModuleList(Layer(args.hidden, args.heads, args.ffn, tp, i + 1)
                                          for i in range(args.layers))

    def forward(self, tokens, caches, pos, all_reduce):
        x = self.embed[tokens]
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache, pos, all_reduce)
        return F.linear(F.rms_norm(x[:, -1], x.shape[-1:]), self.embed).argmax(-1)


def decode(model, args, all_reduce, step=None):
    """Greedy decoding after a prompt; returns (tokens, seconds of the decode steps)."""
    step = model if step is None else step
    heads = args.heads // dist.get_world_size()
    shape = (1, heads, args.prompt + args.tokens, args.hidden // args.heads)
    caches = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
              for _ in model.layers]
    prompt = torch.arange(args.prompt).remainder(args.vocab).unsqueeze(0)
    out = [model(prompt, caches, 0, all_reduce)]
    t0 = time.perf_counter()
    for i in range(args.tokens - 1):
        out.append(step(out[-1].unsqueeze(0), caches, args.prompt + i, all_reduce))
    return torch.cat(out).tolist(), time.perf_counter() - t0


def all_reduce_time(fn, hidden, iters=2000):
    x = torch.ones(1, 1, hidden, dtype=torch.bfloat16)
    for _ in range(100):
        fn(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - t0) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    collx = dist.new_group(backend="collx")
    model = Model(args, tp)

    def on(group):
        def all_reduce(t):
            dist.all_reduce(t, group=group)
            return t
        return all_reduce

    runs = {"gloo": (on(None), None), "collx": (on(collx), None),
            "collx compiled": (on(collx), torch.compile(model, dynamic=True))}
    try:
        import deepspeed.comm as ds
        ds.init_distributed(dist_backend="gloo")
        runs["deepspeed"] = (lambda t: ds.inference_all_reduce(t), None)
    except ImportError:
        if rank == 0:
            print("(deepspeed is not installed: `make bench-setup` adds it)")
    with torch.no_grad():
        for name, (fn, step) in runs.items():  # warm up: compile, first touches
            decode(model, args, fn, step)
        times, tokens = {name: [] for name in runs}, {}
        for _ in range(args.rounds):
            for name, (fn, step) in runs.items():
                dist.barrier()
                tokens[name], seconds = decode(model, args, fn, step)
                t = torch.tensor([seconds])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[name].append(t.item())
        per_op = {name: all_reduce_time(fn, args.hidden) for name, (fn, _) in runs.items()}
    if rank == 0:
        print(f"# tp={tp}, hidden {args.hidden}, {args.layers} layers, {2 * args.layers} all-reduces of "
              f"{2 * args.hidden} B per token, bf16, medians of {args.rounds} rounds")
        print(f"{'all-reduce':16} {'tokens/s':>9} {'us/all-reduce':>14}  tokens as gloo's")
        for name in runs:
            rate = (args.tokens - 1) / statistics.median(times[name])
            print(f"{name:16} {rate:>9.1f} {per_op[name] * 1e6:>14.1f}  {tokens[name] == tokens['gloo']}")
    dist.destroy_process_group()
    if "deepspeed" in runs:  # DeepSpeed leaves this rank's buffer in /dev/shm, named by the job's address and port
        mine = f"_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}_{rank}"
        for name in os.listdir("/dev/shm"):
            if name.startswith("deepspeed_") and name.endswith(mine):
                os.unlink(os.path.join("/dev/shm", name))


if __name__ == "__main__":
    main()
