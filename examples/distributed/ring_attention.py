"""Ring attention with hipflash over torch.distributed: one causal attention over a sequence
sharded across the ranks, forward and backward, checked against the whole sequence on one rank.

    torchrun --nproc_per_node 2 examples/distributed/ring_attention.py            # CPU: gloo
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 examples/distributed/ring_attention.py  # GPUs

    python3 examples/distributed/ring_attention.py --spawn 3                      # no torchrun

(PYTHONPATH must reach the hipflash package, e.g. build/python of a CMake build.) On GPUs each
rank takes the device of its LOCAL_RANK and NCCL; on the CPU, gloo. --spawn N starts N ranks
with torch.multiprocessing instead of torchrun (Debian 12's PyTorch 1.13 torchrun fails under
Python 3.11).
"""
import os
import sys

import torch
import torch.distributed as dist

import hipflash
from hipflash.distributed import ring_flash_attn_func, shard, unshard


def main():
    cuda = torch.cuda.is_available() and hipflash.gpu_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")

    # The whole sequence, the same on every rank (a seeded generator), then this rank's shard.
    batch, seqlen, heads, kv_heads, dim = 1, 512 * 2 * world, 8, 2, 128
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seqlen, h, dim, generator=g).to(torch.bfloat16)
                     for h in (heads, kv_heads, kv_heads, heads))
    q_s, k_s, v_s = (shard(t, rank, world).to(device).requires_grad_() for t in (q, k, v))

    out, lse = ring_flash_attn_func(q_s, k_s, v_s, causal=True, return_lse=True)
    out.backward(shard(dout, rank, world).to(device))

    # Gather every rank's rows and compare with one process on the whole sequence.
    def gathered(t, dim=1):
        t = t.contiguous().float()  # gloo's collectives refuse bfloat16
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return unshard(parts, dim=dim)

    full_out, full_lse, full_dq = gathered(out.detach()), gathered(lse, 2), gathered(q_s.grad)
    if rank == 0:
        q1, k1, v1 = (t.to(device).requires_grad_() for t in (q, k, v))
        ref, ref_lse = hipflash.flash_attn_func(q1, k1, v1, causal=True, return_lse=True)
        ref.backward(dout.to(device))
        print(f"{world} ranks, {seqlen} tokens: max |out - one process| "
              f"{(full_out - ref.float()).abs().max().item():.2e}, |lse| "
              f"{(full_lse - ref_lse).abs().max().item():.2e}, |dq| "
              f"{(full_dq - q1.grad.float()).abs().max().item():.2e}")
    dist.destroy_process_group()


def _spawned(rank, world):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    main()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--spawn":
        torch.multiprocessing.spawn(_spawned, args=(int(sys.argv[2]),), nprocs=int(sys.argv[2]))
    else:
        main()
