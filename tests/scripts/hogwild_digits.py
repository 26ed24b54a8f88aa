"""pytorch/examples' mnist_hogwild, on sklearn's 8x8 digits instead of MNIST (no download).

The program is written for ``torch.multiprocessing``; ``tests/test_dataloader.py`` also runs
it with that one import line swapped for ``import tensormp as mp``. As in the original: the
spawn start method, a ``share_memory()`` model and the training set passed as ``Process``
arguments, each trainer building its own ``DataLoader``. Usage::

    hogwild_digits.py TRAINER_WORKERS EVAL_WORKERS

``TRAINER_WORKERS``: ``num_workers`` of the trainers' loaders (mnist_hogwild's accelerator
setting is 1). ``EVAL_WORKERS``: ``num_workers`` of the parent's evaluation loader over the training set,
run after the trainers (which were given that set) were joined; the test set is evaluated
in the parent.
Prints one JSON line: ``{"train_acc": ..., "test_acc": ..., "trainers": [exit codes]}``.
"""

import json
import sys

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

EPOCHS = 1
BATCH = 8
PROCESSES = 2
SEED = 1


class Digits(torch.utils.data.Dataset):
    """As torchvision's MNIST: two tensors, ``data`` and ``targets``."""

    def __init__(self, data, targets):
        self.data = data
        self.targets = targets

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.data[i], self.targets[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def train(rank, model, dataset, kwargs):
    torch.manual_seed(SEED + rank)
    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(dataset, **kwargs)
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    model.train()
    for _epoch in range(EPOCHS):
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()


def accuracy(model, dataset, num_workers):
    loader = torch.utils.data.DataLoader(dataset, batch_size=256, num_workers=num_workers)
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in loader:
            correct += int((model(data).argmax(dim=1) == target).sum())
    return correct / len(dataset)


def main():
    from sklearn.datasets import load_digits

    trainer_workers, eval_workers = int(sys.argv[1]), int(sys.argv[2])
    mp.set_start_method("spawn", force=True)
    torch.manual_seed(SEED)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    train_set, test_set = Digits(x[:1400].clone(), y[:1400].clone()), Digits(x[1400:], y[1400:])
    model = Net()
    model.share_memory()
    kwargs = {"batch_size": BATCH, "shuffle": True}
    if trainer_workers:
        kwargs["num_workers"] = trainer_workers
    processes = []
    for rank in range(PROCESSES):
        p = mp.Process(target=train, args=(rank, model, train_set, kwargs))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    print(json.dumps({
        "trainers": [p.exitcode for p in processes],
        "train_acc": accuracy(model, train_set, eval_workers),
        "test_acc": accuracy(model, test_set, 0),
    }))


if __name__ == "__main__":
    main()
