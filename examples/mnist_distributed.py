"""The distributed MNIST tutorial's ``mnist-distributed.py``, ported to ddpkit.

The tutorial sets MASTER_ADDR/MASTER_PORT by hand, computes each process's
rank from ``--nodes/--gpus/--nr``, calls ``init_process_group`` and wraps the
ConvNet in torch's DDP. With ddpkit the launcher's environment carries all of
that, so the same file runs

    .venv/bin/python examples/mnist_distributed.py --nprocs 2            # starts its own 2 workers
    .venv/bin/ddpkit launch --nproc-per-node 2 examples/mnist_distributed.py
    .venv/bin/torchrun --nnodes 2 --nproc-per-node 8 ... examples/mnist_distributed.py

Data: the MNIST IDX files with ``--data-dir`` (e.g. ../shared/data/mnist), else
scikit-learn's small digits set scaled to 28x28, which needs no download.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader

import ddpkit
from ddpkit.data.datasets import load_dataset
from ddpkit.runtime.discovery import discover
from ddpkit.models import ConvNet  # the tutorial's ConvNet, layer for layer


def train(rank, args):
    # Replaces the tutorial's rank arithmetic and init_process_group(...):
    # rank, world size and rendezvous come from the environment.
    ctx = ddpkit.init()
    torch.manual_seed(0)
    model = ConvNet().to(ctx.device)
    # DDP broadcasts rank 0's weights, so every replica starts the same.
    model = ddpkit.DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
    criterion = nn.CrossEntropyLoss()
    # The tutorial's SGD(lr=1e-4) needs many epochs; momentum gets there in a few.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # Rank 0 of each node reads (or downloads) first, the others then hit the cache.
    with ddpkit.zero_first():
        data = load_dataset("mnist" if args.data_dir else "digits", data_dir=args.data_dir)
    # Each rank gets a disjoint shard; shuffle=False in the DataLoader because
    # the sampler shuffles (differently each epoch, thanks to set_epoch).
    train_sampler = ddpkit.DistributedSampler(data.train)
    train_loader = DataLoader(data.train, batch_size=args.batch_size, shuffle=False, sampler=train_sampler)

    start = time.time()
    total_step = len(train_loader)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, (images, labels) in enumerate(train_loader):
            images, labels = images.to(ctx.device), labels.to(ctx.device)
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()  # gradients are averaged across ranks during backward
            optimizer.step()
            if (i + 1) % 10 == 0:
                ddpkit.print0(f"Epoch [{epoch + 1}/{args.epochs}], Step [{i + 1}/{total_step}], "
                              f"Loss: {loss.item():.4f}")
    ddpkit.print0(f"Training complete in: {time.time() - start:.1f} s")

    # Evaluation: pad=False gives every test image to exactly one rank, and one
    # all-reduce adds up the counts, so the accuracy is exact.
    test_sampler = ddpkit.DistributedSampler(data.test, shuffle=False, pad=False)
    correct, seen = torch.zeros(1, device=ctx.device), torch.zeros(1, device=ctx.device)
    net = ddpkit.unwrap(model).eval()  # the plain module: no collective per batch
    with torch.no_grad():
        for images, labels in DataLoader(data.test, batch_size=256, sampler=test_sampler):
            predicted = net(images.to(ctx.device)).argmax(1)
            correct += (predicted == labels.to(ctx.device)).sum()
            seen += len(labels)
    dist.all_reduce(correct)
    dist.all_reduce(seen)
    ddpkit.print0(f"Test accuracy: {100 * correct.item() / seen.item():.2f}% on {int(seen.item())} images")
    ddpkit.shutdown()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nprocs", default=2, type=int, help="processes to start when not under a launcher")
    parser.add_argument("--epochs", default=3, type=int, metavar="N", help="number of total epochs to run")
    parser.add_argument("--batch-size", default=32, type=int, help="per process")
    parser.add_argument("--lr", default=0.04, type=float)
    parser.add_argument("--data-dir", default=None, help="MNIST IDX files; default: the digits set")
    args = parser.parse_args()
    if discover(os.environ).scheme != "single":
        train(None, args)  # a launcher (ddpkit launch, torchrun, mpirun, srun) started us
    else:
        ddpkit.spawn(train, nprocs=args.nprocs, args=(args,))  # the tutorial's mp.spawn


if __name__ == "__main__":
    main()
