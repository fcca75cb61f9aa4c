"""Example (c): parambox.DistributedOptimizer inside a plain PyTorch training loop.

    torchrun --nproc-per-node 2 examples/own_loop.py                       # allreduce
    torchrun --nproc-per-node 2 examples/own_loop.py --strategy easgd      # or any data-parallel one
    torchrun --nproc-per-node 2 examples/own_loop.py --device cuda         # a GPU per rank, over nccl
    srun -n 4 python examples/own_loop.py   /   mpiexec -n 4 python examples/own_loop.py
    mpiexec -n 3 python examples/own_loop.py --strategy easgd --box rma   # across nodes: rank 2 holds the box

Each rank trains on its own random batches of the digits data set (it ships with scikit-learn); after
``opt.close()`` every rank holds the run's result and prints the same test accuracy.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import parambox

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="allreduce")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU of this rank's LOCAL_RANK")
parser.add_argument("--box", default="shm", help="shm (one host), or rma (MPI: across nodes)")
args = parser.parse_args()
gpu = int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())
device = torch.device("cuda", gpu) if args.device == "cuda" else torch.device("cpu")

x, y = load_digits(return_X_y=True)
x, y = torch.tensor(x / 16, dtype=torch.float32, device=device), torch.tensor(y, device=device)
train_x, train_y, test_x, test_y = x[:-300], y[:-300], x[-300:], y[-300:]

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
opt = parambox.DistributedOptimizer(model, optimizer, strategy=args.strategy, steps=args.steps, box=args.box)
g = torch.Generator().manual_seed(opt.rank)  # each rank draws its own samples
# opt.trains is False on a rank that only holds the box (--box rma, an asynchronous strategy: the last rank)
for _ in range(args.steps if opt.trains else 0):
    i = torch.randint(0, len(train_x), (32,), generator=g)
    loss = F.cross_entropy(model(train_x[i]), train_y[i])
    opt.zero_grad()
    loss.backward()
    opt.step()
opt.close()  # every rank's model is now the run's result (the center weights for easgd)

with torch.no_grad():
    accuracy = (model(test_x).argmax(1) == test_y).float().mean()
# one write per line: the ranks share the terminal, and print() writes the text and its newline apart
done = f"final loss {loss.item():.3f}" if opt.trains else "held the box"
sys.stdout.write(f"rank {opt.rank}: {args.strategy} {done}, test accuracy {accuracy:.3f}\n")
