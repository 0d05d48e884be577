"""A PyTorch training script written from habit, run by test/test_api_torch.py twice: as it is, with PyTorch, and
with only `import torch` -> `import ourgrad as torch` and `torch.nn.functional` -> `ourgrad.nn.functional` changed.

It writes its losses, test accuracy and printed tensors as JSON to the path in argv[1]. The initial weights come
from argv[2] when that file exists (the PyTorch run writes them there first), so both runs start alike. Dropout has
p=0 so that both runs draw no masks (their random generators differ).
"""
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
  def __init__(self):
    super().__init__()
    self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)  # a bias before BatchNorm has a zero gradient
    self.bn = nn.BatchNorm2d(4)
    self.drop = nn.Dropout(p=0.0)
    self.fc1 = nn.Linear(4 * 4 * 4, 16)
    self.fc2 = nn.Linear(16, 3)

  def forward(self, x):
    x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
    x = torch.flatten(x, 1)
    x = self.drop(F.relu(self.fc1(x)))
    return self.fc2(x)


def main(out_path, init_path):
  torch.manual_seed(0)
  rng = np.random.RandomState(0)
  images = rng.randn(96, 1, 8, 8).astype(np.float32)
  labels = (images.reshape(96, -1)[:, :3].argmax(1)).astype(np.int64)
  train = torch.utils.data.TensorDataset(torch.from_numpy(images[:80]), torch.from_numpy(labels[:80]))
  loader = torch.utils.data.DataLoader(train, batch_size=16, shuffle=False, drop_last=True)

  model = Net()
  if os.path.exists(init_path): model.load_state_dict(torch.load(init_path))
  else: torch.save(model.state_dict(), init_path)

  decay = [p for name, p in model.named_parameters() if name.endswith("weight") and p.ndim > 1]
  no_decay = [p for name, p in model.named_parameters() if not (name.endswith("weight") and p.ndim > 1)]
  optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=3e-2, betas=(0.9, 0.99))
  scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)

  losses, norms, lrs = [], [], []
  model.train()
  for epoch in range(4):
    for x, y in loader:
      optimizer.zero_grad()
      loss = F.cross_entropy(model(x), y)
      loss.backward()
      norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)))
      optimizer.step()
      scheduler.step()
      losses.append(loss.item())
      lrs.append(optimizer.param_groups[0]["lr"])

  model.eval()
  with torch.no_grad():
    test_x, test_y = torch.tensor(images[80:]), torch.tensor(labels[80:])
    logits = model(test_x)
    accuracy = (logits.argmax(dim=1) == test_y).float().mean().item()
    no_grad_flag = logits.requires_grad

  saved = out_path + ".weights"
  torch.save(model.state_dict(), saved)
  again = Net()
  again.load_state_dict(torch.load(saved))
  again.eval()
  with torch.no_grad():
    reloaded_max_diff = (again(test_x) - logits).abs().max().item()

  printed = [str(torch.tensor([[1.0, -2.5], [3.25, 4.0]])), str(torch.arange(5)), str(torch.zeros(2, 3) + 1),
             repr(torch.tensor([True, False]))]
  print(model.bn.running_mean)
  with open(out_path, "w") as file:
    json.dump({"losses": losses, "norms": norms, "lrs": lrs, "accuracy": accuracy, "no_grad_flag": no_grad_flag,
               "reloaded_max_diff": reloaded_max_diff, "printed": printed,
               "running_mean": model.bn.running_mean.tolist()}, file)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
