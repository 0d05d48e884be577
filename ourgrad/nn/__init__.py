"""Neural-network building blocks, PyTorch's torch.nn in one namespace:

- `Module`, `Sequential`, `ModuleList`, `ModuleDict`, `Parameter` (ourgrad/nn/module.py);
- layers with parameters: Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d, BatchNorm*, LayerNorm, GroupNorm,
  InstanceNorm*, RMSNorm, Embedding, Dropout (ourgrad/nn/layers.py), MultiheadAttention (ourgrad/nn/attention.py);
- recurrent layers LSTMCell, GRUCell, LSTM, GRU (ourgrad/nn/recurrent.py) and TransformerEncoderLayer,
  TransformerEncoder (ourgrad/nn/transformer.py), with PyTorch's parameter names;
- parameter-free layers: activations, Flatten, Identity, pooling, Upsample, loss modules (ourgrad/nn/stateless.py);
- the submodules `functional`, `losses`, `attention`, `optim`, `state`, `init` (torch.nn.init) and `utils`
  (clip_grad_norm_), imported with this package, so `import ourgrad.nn as nn; nn.optim.Adam; nn.state.safe_save;
  nn.init.kaiming_uniform_; nn.utils.clip_grad_norm_` work.

Layers are also usable tinygrad style, without Module methods: plain classes holding them work with
`nn.state.get_parameters` / `get_state_dict`.
"""
from ourgrad.nn import functional, init, losses, optim, state, utils
from ourgrad.nn import attention
from ourgrad.nn.attention import MultiheadAttention
from ourgrad.nn.layers import (BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d, Conv1d, Conv2d, Conv3d,
                               ConvTranspose1d, ConvTranspose2d, ConvTranspose3d, Dropout, Embedding, GroupNorm,
                               InstanceNorm1d, InstanceNorm2d, LayerNorm, Linear, RMSNorm)
from ourgrad.nn.module import Module, ModuleDict, ModuleList, Parameter, Sequential
from ourgrad.nn.stateless import (ELU, GELU, AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d, AvgPool1d,
                                  AvgPool2d, AvgPool3d, BCELoss, BCEWithLogitsLoss, CrossEntropyLoss, Flatten,
                                  Hardtanh, Identity, L1Loss, LeakyReLU, LogSoftmax, MaxPool1d, MaxPool2d, MaxPool3d,
                                  MSELoss, NLLLoss, ReLU, ReLU6, Sigmoid, SiLU, Softmax, Softplus, Tanh, Upsample)
from ourgrad.nn.stateless import Fold, MaxUnpool1d, MaxUnpool2d, Unfold
from ourgrad.nn import recurrent, transformer
from ourgrad.nn.recurrent import GRU, LSTM, GRUCell, LSTMCell
from ourgrad.nn.transformer import TransformerEncoder, TransformerEncoderLayer

__all__ = ["attention", "functional", "init", "losses", "optim", "state", "utils", "Module", "ModuleDict",
           "ModuleList", "Parameter", "Sequential", "MultiheadAttention", "Linear", "Conv1d", "Conv2d", "Conv3d",
           "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "BatchNorm", "BatchNorm1d", "BatchNorm2d",
           "BatchNorm3d", "LayerNorm", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "RMSNorm", "Embedding",
           "Dropout", "ReLU", "ReLU6", "GELU", "SiLU", "Sigmoid", "Tanh", "LeakyReLU", "ELU", "Softplus", "Hardtanh",
           "Softmax", "LogSoftmax", "Flatten", "Identity", "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d",
           "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "Upsample",
           "CrossEntropyLoss", "NLLLoss", "MSELoss", "L1Loss", "BCELoss", "BCEWithLogitsLoss"]
__all__ += ["MaxUnpool1d", "MaxUnpool2d", "Unfold", "Fold", "recurrent", "transformer", "LSTMCell", "GRUCell",
            "LSTM", "GRU", "TransformerEncoderLayer", "TransformerEncoder"]
