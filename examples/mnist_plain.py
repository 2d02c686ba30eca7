"""PyTorch's MNIST example (pytorch/examples, mnist/main.py) on scikit-learn's digits, as a
plain single-process script: a conv net with dropout, Adadelta, StepLR, a test pass after
every epoch, train/eval modes. ``mnist_port.py`` is the same script made elastic; the two
differ in a handful of lines (``diff examples/mnist_plain.py examples/mnist_port.py``).

    python examples/mnist_plain.py

The digits (1,797 8x8 images) ship with scikit-learn, so nothing is downloaded; a fixed 80 %
trains, the rest tests.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def synced(output, target, loss):
    """The batch's accuracy over every process and the mean of the processes' losses, as a
    metric's ``sync_dist`` and a logging gather compute them when the script runs
    distributed. A process without a batch (``output`` None) adds nothing but takes part."""
    counts = torch.zeros(2)
    if output is not None:
        counts += torch.tensor([float(output.argmax(dim=1).eq(target).sum()), float(len(target))])
    losses = [None if loss is None else loss.item()]
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
        losses = [None] * dist.get_world_size()
        dist.all_gather_object(losses, None if loss is None else loss.item())
    losses = [x for x in losses if x is not None]
    return (counts[0] / counts[1]).item(), sum(losses) / len(losses)


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        accuracy, mean_loss = synced(output, target, loss)
        if batch_idx % args.log_interval == 0:
            print(
                f"Train Epoch: {epoch} [{batch_idx * args.batch_size}/{len(train_loader.dataset)}]"
                f"\tAll: {accuracy:.4f} {mean_loss:.6f}"
            )
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    n = len(test_loader.dataset)
    print(f"Test set: Average loss: {test_loss / n:.4f}, Accuracy: {correct}/{n} ({correct / n})")


def digits(train):
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target)
    i = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n = len(x) * 4 // 5
    return TensorDataset(x[i[:n]], y[i[:n]]) if train else TensorDataset(x[i[n:]], y[i[n:]])


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example, on digits")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--save-model", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    train_kwargs = {"batch_size": args.batch_size, "shuffle": True, "num_workers": 1}
    test_kwargs = {"batch_size": args.test_batch_size}
    dataset1 = digits(train=True)
    dataset2 = digits(train=False)
    train_loader = DataLoader(dataset1, **train_kwargs)
    test_loader = DataLoader(dataset2, **test_kwargs)

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()

    if args.save_model:
        torch.save(model.state_dict(), "mnist_cnn.pt")


if __name__ == "__main__":
    main()
