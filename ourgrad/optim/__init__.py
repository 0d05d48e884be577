"""torch.optim's namespace: the optimizers of ourgrad/nn/optim.py (SGD, Adam, AdamW, LAMB, Optimizer) and the
learning-rate schedulers in `lr_scheduler` (StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR,
LambdaLR, SequentialLR, OneCycleLR). `ourgrad.optim.Adam` is `ourgrad.nn.optim.Adam`."""
from ourgrad.nn.optim import LAMB, SGD, Adam, AdamW, Optimizer, ParamGroup
from ourgrad.optim import lr_scheduler

__all__ = ["Optimizer", "ParamGroup", "SGD", "Adam", "AdamW", "LAMB", "lr_scheduler"]
