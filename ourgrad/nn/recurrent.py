"""Recurrent layers with torch.nn's names, parameters and state-dict keys: LSTMCell, GRUCell, LSTM, GRU.

A cell is one step, composed from Tensor ops: the input and hidden projections (two matmuls), the gates (sigmoid and
tanh on slices of them, in PyTorch's gate order: i, f, g, o for the LSTM; r, z, n for the GRU) and the new state.
The sequence layers project the whole input sequence at once (one matmul for every time step) and then run the cell's
hidden-state recurrence step by step, so a sequence of length L builds L small hidden matmuls; the graph stays lazy
until it is used, and each step's state is its own buffer (contiguous, in the cells too, for loops written over
them), so a step's kernels never recompute the steps before it. Each time step reads its slice of the projected
input at its own offset, so a first call compiles about a dozen kernels per step (cached afterwards). Weights are
named as PyTorch names them (weight_ih_l0, weight_hh_l0_reverse, ...) and initialised like it (uniform in
+-1/sqrt(hidden_size)), so a torch state_dict loads with load_state_dict.
"""
from __future__ import annotations

import math

from ourgrad.errors import ShapeError
from ourgrad.nn.module import Module
from ourgrad.tensor import Tensor

__all__ = ["LSTMCell", "GRUCell", "LSTM", "GRU"]

_GATES = {"LSTM": 4, "GRU": 3}


def _uniform(shape: tuple[int, ...], hidden_size: int) -> Tensor:
  """PyTorch's recurrent init: every weight and bias uniform in [-1/sqrt(hidden_size), 1/sqrt(hidden_size)]."""
  bound = 1.0 / math.sqrt(hidden_size)
  return Tensor.uniform(*shape, low=-bound, high=bound, requires_grad=True)


def _lstm_step(projected_input: Tensor, h: Tensor, c: Tensor, weight_hh: Tensor,
               bias_hh: Tensor | None) -> tuple[Tensor, Tensor]:
  """One LSTM step from the input's projection x W_ih^T + b_ih: gates i, f, g, o (PyTorch's order)."""
  gates = projected_input + h.linear(weight_hh, bias_hh)
  i, f, g, o = gates.chunk(4, dim=-1)
  # each step's state is its own buffer: otherwise, in a loop over steps, the scheduler fuses the whole elementwise
  # chain c_t = f * c_{t-1} + ... into every later matmul and recomputes all earlier steps there (megabyte kernels)
  c = (f.sigmoid() * c + i.sigmoid() * g.tanh()).contiguous()
  return (o.sigmoid() * c.tanh()).contiguous(), c


def _gru_step(projected_input: Tensor, h: Tensor, weight_hh: Tensor, bias_hh: Tensor | None) -> Tensor:
  """One GRU step from the input's projection: r, z, n (PyTorch's order); the reset gate scales the hidden part of
  n after its bias, as PyTorch (and cuDNN) compute it."""
  input_r, input_z, input_n = projected_input.chunk(3, dim=-1)
  hidden_r, hidden_z, hidden_n = h.linear(weight_hh, bias_hh).chunk(3, dim=-1)
  r, z = (input_r + hidden_r).sigmoid(), (input_z + hidden_z).sigmoid()
  n = (input_n + r * hidden_n).tanh()
  return ((1.0 - z) * n + z * h).contiguous()  # its own buffer, as in _lstm_step


class _CellBase(Module):
  mode = ""

  def __init__(self, input_size: int, hidden_size: int, bias: bool = True):
    self.input_size, self.hidden_size = input_size, hidden_size
    gates = _GATES[self.mode] * hidden_size
    self.weight_ih = _uniform((gates, input_size), hidden_size)
    self.weight_hh = _uniform((gates, hidden_size), hidden_size)
    self.bias_ih = _uniform((gates,), hidden_size) if bias else None
    self.bias_hh = _uniform((gates,), hidden_size) if bias else None

  def extra_repr(self) -> str: return f"{self.input_size}, {self.hidden_size}, bias={self.bias_ih is not None}"

  def _batched(self, x: Tensor) -> tuple[Tensor, bool]:
    """The input as (N, input_size), and whether it came unbatched ((input_size,))."""
    if x.ndim not in (1, 2) or x.shape[-1] != self.input_size:
      raise ShapeError(f"{type(self).__name__}({self.input_size}, {self.hidden_size}) takes input of shape "
                       f"(N, {self.input_size}) or ({self.input_size},), got {x.shape}")
    return (x.unsqueeze(0), True) if x.ndim == 1 else (x, False)

  def _state(self, state: Tensor | None, x: Tensor, unbatched: bool) -> Tensor:
    if state is None: return Tensor.zeros(x.shape[0], self.hidden_size, dtype=x.dtype, device=x.device)
    state = state.unsqueeze(0) if unbatched else state
    if state.shape != (x.shape[0], self.hidden_size):
      raise ShapeError(f"{type(self).__name__}: hidden state of shape {state.shape}, expected "
                       f"{(x.shape[0], self.hidden_size)}")
    return state


class LSTMCell(_CellBase):
  """One LSTM step, like torch.nn.LSTMCell: forward(input (N, I) or (I,), (h, c) or None) -> (h', c'). Parameters
  weight_ih (4H, I), weight_hh (4H, H), bias_ih, bias_hh (4H,), gates in PyTorch's order i, f, g, o."""
  mode = "LSTM"

  def forward(self, x: Tensor, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    x, unbatched = self._batched(x)
    h, c = (None, None) if hx is None else hx
    h, c = self._state(h, x, unbatched), self._state(c, x, unbatched)
    h, c = _lstm_step(x.linear(self.weight_ih, self.bias_ih), h, c, self.weight_hh, self.bias_hh)
    return (h.squeeze(0), c.squeeze(0)) if unbatched else (h, c)


class GRUCell(_CellBase):
  """One GRU step, like torch.nn.GRUCell: forward(input (N, I) or (I,), h or None) -> h'. Parameters weight_ih
  (3H, I), weight_hh (3H, H), bias_ih, bias_hh (3H,), gates in PyTorch's order r, z, n."""
  mode = "GRU"

  def forward(self, x: Tensor, hx: Tensor | None = None) -> Tensor:
    x, unbatched = self._batched(x)
    h = _gru_step(x.linear(self.weight_ih, self.bias_ih), self._state(hx, x, unbatched), self.weight_hh,
                  self.bias_hh)
    return h.squeeze(0) if unbatched else h


class _RNNBase(Module):
  mode = ""

  def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
               batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False):
    if num_layers < 1: raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    if not 0.0 <= dropout <= 1.0: raise ValueError(f"dropout must be in [0, 1], got {dropout}")
    self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
    self.bias, self.batch_first, self.dropout, self.bidirectional = bias, batch_first, dropout, bidirectional
    gates = _GATES[self.mode] * hidden_size
    directions = 2 if bidirectional else 1
    # attribute order = PyTorch's state-dict order: per layer, per direction, weight_ih, weight_hh, bias_ih, bias_hh
    for layer in range(num_layers):
      layer_input = input_size if layer == 0 else hidden_size * directions
      for suffix in ("", "_reverse")[:directions]:
        setattr(self, f"weight_ih_l{layer}{suffix}", _uniform((gates, layer_input), hidden_size))
        setattr(self, f"weight_hh_l{layer}{suffix}", _uniform((gates, hidden_size), hidden_size))
        if bias:
          setattr(self, f"bias_ih_l{layer}{suffix}", _uniform((gates,), hidden_size))
          setattr(self, f"bias_hh_l{layer}{suffix}", _uniform((gates,), hidden_size))

  def extra_repr(self) -> str:
    return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, batch_first={self.batch_first}, "
            f"bidirectional={self.bidirectional}")

  def _weights(self, layer: int, suffix: str) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    names = [f"{kind}_l{layer}{suffix}" for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    return tuple(getattr(self, name, None) for name in names)  # type: ignore[return-value]

  def _sequence_first(self, x: Tensor) -> tuple[Tensor, bool]:
    """The input as (L, N, input_size), and whether it came unbatched ((L, input_size))."""
    if x.ndim not in (2, 3) or x.shape[-1] != self.input_size:
      raise ShapeError(f"{type(self).__name__}(input_size={self.input_size}) takes (L, N, {self.input_size}) "
                       f"(or (N, L, {self.input_size}) with batch_first, or unbatched (L, {self.input_size})), got "
                       f"{x.shape}")
    if x.ndim == 2: return x.unsqueeze(1), True
    return (x.transpose(0, 1), False) if self.batch_first else (x, False)

  def _initial(self, state: Tensor | None, batch: int, unbatched: bool, like: Tensor) -> Tensor:
    """An initial state as (layers * directions, N, H): the one given, or zeros."""
    count = self.num_layers * (2 if self.bidirectional else 1)
    if state is None: return Tensor.zeros(count, batch, self.hidden_size, dtype=like.dtype, device=like.device)
    state = state.unsqueeze(1) if unbatched else state
    if state.shape != (count, batch, self.hidden_size):
      raise ShapeError(f"{type(self).__name__}: initial state of shape {state.shape}, expected "
                       f"{(count, batch, self.hidden_size)}")
    return state

  def _run_direction(self, x: Tensor, layer: int, suffix: str, h: Tensor, c: Tensor | None
                     ) -> tuple[Tensor, Tensor, Tensor | None]:
    """One direction of one layer over the sequence x (L, N, I): (outputs (L, N, H), last h, last c)."""
    weight_ih, weight_hh, bias_ih, bias_hh = self._weights(layer, suffix)
    projected = x.linear(weight_ih, bias_ih)  # every time step's input projection in one matmul
    steps = range(x.shape[0] - 1, -1, -1) if suffix else range(x.shape[0])
    outputs: list[Tensor] = [None] * x.shape[0]  # type: ignore[list-item]
    for step in steps:
      if c is None: h = _gru_step(projected[step], h, weight_hh, bias_hh)
      else: h, c = _lstm_step(projected[step], h, c, weight_hh, bias_hh)
      outputs[step] = h
    return Tensor.stack(outputs), h, c

  def _run(self, x: Tensor, h0: Tensor, c0: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """All layers over x (L, N, I): (output (L, N, D*H), h_n (layers*D, N, H), c_n or None)."""
    directions = ("", "_reverse") if self.bidirectional else ("",)
    last_h: list[Tensor] = []
    last_c: list[Tensor] = []
    for layer in range(self.num_layers):
      outputs = []
      for number, suffix in enumerate(directions):
        state = layer * len(directions) + number
        out, h, c = self._run_direction(x, layer, suffix, h0[state], None if c0 is None else c0[state])
        outputs.append(out)
        last_h.append(h)
        if c is not None: last_c.append(c)
      x = outputs[0] if len(outputs) == 1 else outputs[0].cat(outputs[1], dim=-1)
      # dropout between layers (not after the last), while training, as PyTorch
      if self.dropout > 0 and layer < self.num_layers - 1: x = x.dropout(self.dropout, self.training)
    return x, Tensor.stack(last_h), Tensor.stack(last_c) if last_c else None

  def _output(self, output: Tensor, unbatched: bool) -> Tensor:
    if unbatched: return output.squeeze(1)
    return output.transpose(0, 1) if self.batch_first else output


class LSTM(_RNNBase):
  """A multi-layer LSTM, like torch.nn.LSTM (num_layers, bias, batch_first, dropout between layers,
  bidirectional; no proj_size). forward(input, (h0, c0) or None) -> (output, (h_n, c_n)): input (L, N, I),
  (N, L, I) with batch_first, or unbatched (L, I); output (L, N, D*H); h_n and c_n (num_layers*D, N, H) (always
  sequence-independent of batch_first, as in PyTorch). Parameters weight_ih_l{k}[_reverse] (4H, in),
  weight_hh_l{k}[_reverse] (4H, H), bias_ih_l{k}[_reverse], bias_hh_l{k}[_reverse] (4H,)."""
  mode = "LSTM"

  def forward(self, x: Tensor, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    x, unbatched = self._sequence_first(x)
    h0, c0 = (None, None) if hx is None else hx
    h0, c0 = self._initial(h0, x.shape[1], unbatched, x), self._initial(c0, x.shape[1], unbatched, x)
    output, h_n, c_n = self._run(x, h0, c0)
    assert c_n is not None
    if unbatched: h_n, c_n = h_n.squeeze(1), c_n.squeeze(1)
    return self._output(output, unbatched), (h_n, c_n)


class GRU(_RNNBase):
  """A multi-layer GRU, like torch.nn.GRU (num_layers, bias, batch_first, dropout between layers, bidirectional).
  forward(input, h0 or None) -> (output, h_n), shapes as for LSTM; parameters as for LSTM with 3H gate rows."""
  mode = "GRU"

  def forward(self, x: Tensor, hx: Tensor | None = None) -> tuple[Tensor, Tensor]:
    x, unbatched = self._sequence_first(x)
    output, h_n, _ = self._run(x, self._initial(hx, x.shape[1], unbatched, x), None)
    return self._output(output, unbatched), h_n.squeeze(1) if unbatched else h_n
