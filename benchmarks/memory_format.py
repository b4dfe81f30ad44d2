#!/usr/bin/env python
"""Input memory layout and the speed of PFLlib's CIFAR CNN on this CPU (a script, not a test; issue 37).

The forward pass over one client's 167 test images and a training epoch of 500 images at
batch 10, one thread, with the images NCHW contiguous (how pfl's data build holds them) and
channels-last. See docs/benchmarks.md ("Where the evaluation's time goes").

    python benchmarks/memory_format.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn


def pfllib_cnn() -> nn.Module:
    """PFLlib's FedAvgCNN for 32x32x3 inputs: conv5x5(32), pool, conv5x5(64), pool, fc 1600->512, fc 512->10."""
    return nn.Sequential(nn.Conv2d(3, 32, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1600, 512), nn.ReLU(), nn.Linear(512, 10))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = pfllib_cnn()
    nhwc = torch.rand(500, 32, 32, 3).permute(0, 3, 1, 2)  # as an npz of uint8 NHWC images is read
    labels = torch.randint(0, 10, (500,))
    layouts = {"NCHW contiguous": nhwc.contiguous(), "channels-last": nhwc.contiguous(memory_format=torch.channels_last)}
    for name, x in layouts.items():
        model.eval()
        with torch.no_grad():
            model(x[:167])
            times = []
            for _ in range(args.repeats):
                begun = time.perf_counter()
                model(x[:167])
                times.append(time.perf_counter() - begun)
        model.train()
        optimiser = torch.optim.SGD(model.parameters(), lr=0.005)
        epochs = []
        for _ in range(2):  # the second epoch is timed: the first pays for warming up
            begun = time.perf_counter()
            for start in range(0, 500, 10):
                optimiser.zero_grad()
                F.cross_entropy(model(x[start:start + 10]), labels[start:start + 10]).backward()
                optimiser.step()
            epochs.append(time.perf_counter() - begun)
        epoch = epochs[-1]
        print(f"{name:16s} forward of 167 images: {min(times) * 1e3:7.1f} ms (x100 clients: {min(times) * 100:.2f} s); "
              f"training epoch of 500 at batch 10: {epoch:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
