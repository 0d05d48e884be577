"""Several devices on one CPU (CLANG:0 and CLANG:1): indexed device names, collectives against numpy, sharded
tensors against numpy and PyTorch, data-parallel training against the single-device step, and the NCCL binding
(which only loads the library here; the NCCL collectives need two GPUs and skip without them)."""
import os

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.device import Device
from ourgrad.distributed import collectives
from ourgrad.distributed.data_parallel import DataParallel, grad_buckets
from ourgrad.dtype import dtypes
from ourgrad.errors import DeviceError, ShardingError
from ourgrad.multi import MultiLazyBuffer
from ourgrad.nn import Linear
from ourgrad.nn.optim import SGD, Adam, AdamW
from ourgrad.nn.state import get_state_dict, load_state_dict

D2 = ("CLANG:0", "CLANG:1")
D3 = ("CLANG:0", "CLANG:1", "CLANG:2")
RNG = np.random.default_rng(0)


def values(shape, dtype=np.float32):
  if np.issubdtype(dtype, np.integer): return RNG.integers(-50, 50, size=shape).astype(dtype)
  return RNG.standard_normal(shape).astype(dtype)


def per_device(arrays, devices):
  return [Tensor(array, device=device).lazydata for array, device in zip(arrays, devices)]


def read(lazies):
  return [Tensor(lazy).numpy() for lazy in lazies]


# ---------------------------------------------------------------- device names

def test_indexed_device_names():
  assert Device.canonicalize("clang:0") == "CLANG" and Device.canonicalize("cpu:1") == "CLANG:1"
  assert Device.canonicalize("cuda:2") == "CUDA:2" and Device.canonicalize("CUDA") == "CUDA"
  first, second = Device["CLANG"], Device["CLANG:1"]
  assert first is Device["CLANG:0"] and second is not first and second.name == "CLANG:1"
  assert second.allocator is not first.allocator  # memory of its own
  assert second.compiler is first.compiler and second.renderer is first.renderer  # kernels compiled once
  t = Tensor([1.0, 2.0], device="CLANG:1")
  assert t.device == "CLANG:1" and (t * 3).to("CLANG").tolist() == [3.0, 6.0]


# ---------------------------------------------------------------- collectives against numpy

@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 5)])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_allreduce(shape, dtype, op):
  arrays = [values(shape, dtype) for _ in D3]
  expected = np.sum(arrays, axis=0) if op == "sum" else np.max(arrays, axis=0)
  results = collectives.allreduce(per_device(arrays, D3), op)
  assert [lazy.device for lazy in results] == ["CLANG", "CLANG:1", "CLANG:2"]
  for result in read(results): np.testing.assert_allclose(result, expected, rtol=1e-6)


def test_cpu_allreduce_schedules_copies_and_one_fused_add():
  """3 devices: 2 copies in, one kernel adding all three (fused), 2 copies out; the inputs' own math fuses too."""
  from ourgrad.engine.schedule import create_schedule
  from ourgrad.ops import Ops
  inputs = [(Tensor(values((4, 4)), device=device) * 2).lazydata for device in D3]
  items = create_schedule(collectives.allreduce(inputs))
  copies = [item for item in items if item.ast.op is Ops.COPY]
  kernels = [item for item in items if item.ast.op is not Ops.COPY]
  assert (len(copies), len(kernels)) == (4, 3)  # kernels: the *2 on CLANG:1 and CLANG:2, then *2 + adds on CLANG


@pytest.mark.parametrize("axis", [0, 1])
def test_allgather_uneven(axis):
  shapes = [(2, 3), (4, 3), (1, 3)] if axis == 0 else [(3, 1), (3, 4), (3, 2)]
  arrays = [values(shape) for shape in shapes]
  results = collectives.allgather(per_device(arrays, D3), axis)
  for result in read(results): np.testing.assert_array_equal(result, np.concatenate(arrays, axis))


@pytest.mark.parametrize("root", [0, 2])
def test_broadcast(root):
  arrays = [values((4, 2), np.int32) for _ in D3]
  for result in read(collectives.broadcast(per_device(arrays, D3), root)): np.testing.assert_array_equal(result,
                                                                                                          arrays[root])


@pytest.mark.parametrize("length, axis", [(6, 0), (7, 0), (5, 1)])
def test_reduce_scatter(length, axis):
  shape = (length, 3) if axis == 0 else (2, length)
  arrays = [values(shape) for _ in D3]
  expected = np.array_split(np.sum(arrays, axis=0), 3, axis=axis)
  for result, piece in zip(read(collectives.reduce_scatter(per_device(arrays, D3), axis)), expected):
    np.testing.assert_allclose(result, piece, rtol=1e-6)


def test_collective_errors_name_shapes_and_devices():
  a, b = Tensor(values((2, 3)), device="CLANG").lazydata, Tensor(values((3, 3)), device="CLANG:1").lazydata
  with pytest.raises(ShardingError, match=r"\(2, 3\).*CLANG.*\(3, 3\).*CLANG:1"): collectives.allreduce([a, b])
  with pytest.raises(ShardingError, match="repeat"): collectives.allreduce([a, a])
  with pytest.raises(ShardingError, match="split sizes"): collectives.reduce_scatter([a, a.copy_to_device("CLANG:1")],
                                                                                     0, split_sizes=[1, 2])


# ---------------------------------------------------------------- sharded tensors

def test_shard_gather_roundtrip_uneven():
  data = values((5, 4))
  x = Tensor(data).shard(D2, axis=0)
  assert x.device == ("CLANG", "CLANG:1") and isinstance(x.lazydata, MultiLazyBuffer)
  assert [lb.shape for lb in x.lazydata.lbs] == [(3, 4), (2, 4)] and x.shape == (5, 4)
  np.testing.assert_array_equal(x.numpy(), data)
  gathered = x.to("CLANG:1")
  assert gathered.device == "CLANG:1"
  np.testing.assert_array_equal(gathered.numpy(), data)
  replicated = Tensor(data).shard(D2)
  assert replicated.lazydata.axis is None and all(lb.shape == (5, 4) for lb in replicated.lazydata.lbs)


def test_elementwise_sharded_with_replicated_and_scalars():
  a, b, c = values((6, 4)), values((6, 4)), values((4,))
  x, y, z = Tensor(a).shard(D3, 0), Tensor(b).shard(D3, 0), Tensor(c).shard(D3)
  result = ((x * y + z) / 2 - 1).exp()
  assert result.lazydata.axis == 0
  np.testing.assert_allclose(result.numpy(), np.exp((a * b + c) / 2 - 1), rtol=1e-5)


@pytest.mark.parametrize("shard_axis", [0, 1])
@pytest.mark.parametrize("reduce_axis", [0, 1, None])
def test_reductions(shard_axis, reduce_axis):
  data = values((5, 7))
  x = Tensor(data).shard(D2, shard_axis)
  for ours, reference in ((x.sum(reduce_axis), data.sum(reduce_axis)), (x.max(reduce_axis), data.max(reduce_axis)),
                          (x.mean(reduce_axis), data.mean(reduce_axis))):
    np.testing.assert_allclose(ours.numpy(), reference, rtol=1e-5, atol=1e-6)
    crosses = reduce_axis is None or reduce_axis == shard_axis
    kept_axis = shard_axis - (1 if reduce_axis is not None and reduce_axis < shard_axis else 0)  # keepdim=False
    assert ours.lazydata.axis == (None if crosses else kept_axis)


def test_matmul_batch_sharded_and_k_sharded():
  a, w = values((7, 6)), values((6, 5))
  batch_sharded = Tensor(a).shard(D2, 0) @ Tensor(w).shard(D2)
  assert batch_sharded.lazydata.axis == 0
  np.testing.assert_allclose(batch_sharded.numpy(), a @ w, rtol=1e-5, atol=1e-5)
  k_sharded = Tensor(a).shard(D3, 1) @ Tensor(w).shard(D3, 0)  # partial sums on each device, then an allreduce
  assert k_sharded.lazydata.axis is None
  np.testing.assert_allclose(k_sharded.numpy(), a @ w, rtol=1e-5, atol=1e-5)


def test_movement_ops_follow_or_refuse():
  data = values((4, 6))
  x = Tensor(data).shard(D2, 0)
  assert x.T.lazydata.axis == 1
  np.testing.assert_array_equal(x.T.numpy(), data.T)
  np.testing.assert_array_equal(x.reshape(4, 2, 3).numpy(), data.reshape(4, 2, 3))
  np.testing.assert_array_equal(x.reshape(24).numpy(), data.reshape(24))  # row-major pieces stay whole
  np.testing.assert_array_equal(x[:, 1:4].numpy(), data[:, 1:4])
  np.testing.assert_array_equal(x.reshape(6, 4).numpy(), data.reshape(6, 4))  # 12 elements a shard: 3 rows each
  uneven = Tensor(values((5, 4))).shard(D2, 0)  # 12 and 8 elements: rows of 5 would straddle the shards
  with pytest.raises(ShardingError, match=r"\(5, 4\) -> \(4, 5\).*axis 0.*CLANG"): uneven.reshape(4, 5)
  with pytest.raises(ShardingError, match="shrink of the shard axis 0"): x[1:3]
  with pytest.raises(ShardingError, match="pad of the shard axis 0"): x.pad(((1, 0), (0, 0)))
  with pytest.raises(ShardingError, match="flip of the shard axis 0"): x.flip(0)


def test_mismatched_shardings_raise():
  data = values((4, 4))
  with pytest.raises(ShardingError, match=r"axis 0.*axis 1"): Tensor(data).shard(D2, 0) + Tensor(data).shard(D2, 1)
  with pytest.raises(DeviceError, match=r"different devices.*'CLANG:2'"):
    Tensor(data).shard(D2, 0) + Tensor(data).shard(D3, 0)
  with pytest.raises(DeviceError, match="different devices"): Tensor(data).shard(D2, 0) + Tensor(data)
  with pytest.raises(ShardingError, match="repeat"): Tensor(data).shard(("CLANG:1", "CLANG:1"))


def test_autograd_replicated_weight_gets_allreduced_grad():
  import torch
  a, w = values((6, 4)), values((4, 3))
  weight = Tensor(w, requires_grad=True).shard_(D2)
  ((Tensor(a).shard(D2, 0) @ weight).relu().sum(1) ** 2).mean().backward()
  assert weight.grad.lazydata.axis is None  # replicated: the batch axis was reduced across devices
  torch_weight = torch.tensor(w, requires_grad=True)
  ((torch.tensor(a) @ torch_weight).relu().sum(1) ** 2).mean().backward()
  for lb in weight.grad.lazydata.lbs:
    np.testing.assert_allclose(Tensor(lb).numpy(), torch_weight.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, None])
def test_gradient_flows_back_through_shard(axis):
  import torch
  w, a = values((5, 4)), values((5, 4))
  weight = Tensor(w, requires_grad=True)
  sharded = weight.shard(D2, axis)
  ((sharded * Tensor(a).shard(D2, axis)).sum() + (sharded * sharded).sum()).backward()
  torch_weight = torch.tensor(w, requires_grad=True)
  ((torch_weight * torch.tensor(a)).sum() + (torch_weight * torch_weight).sum()).backward()
  assert weight.grad is not None and weight.grad.device == weight.device   # gathered onto the unsharded tensor's device
  np.testing.assert_allclose(weight.grad.numpy(), torch_weight.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_gradient_flows_back_through_a_reshard():
  import torch
  w = values((6, 3))
  weight = Tensor(w, requires_grad=True).shard_(D2, 0)
  resharded = weight.shard(D2, 1)   # another cut of a tensor already over the devices
  (resharded * resharded * 3).sum().backward()
  assert weight.grad.lazydata.axis == 0 and weight.grad.device == weight.device   # cut as the weight is
  torch_weight = torch.tensor(w, requires_grad=True)
  (torch_weight * torch_weight * 3).sum().backward()
  np.testing.assert_allclose(weight.grad.numpy(), torch_weight.grad.numpy(), rtol=1e-5, atol=1e-6)


def _sharded_linear() -> Linear:
  layer = Linear(4, 3)   # 3 output rows over 2 devices: pieces of 2 and 1
  layer.weight.shard_(D2, 0)
  layer.bias.shard_(D2)
  return layer


def test_load_state_dict_into_a_sharded_model_keeps_the_sharding_and_the_buffers():
  layer = _sharded_linear()   # still lazy: the first load gives every shard a buffer of its own
  load_state_dict(layer, {"weight": Tensor(values((3, 4))), "bias": Tensor(values((3,)))})
  buffers = [lb.realized for tensor in (layer.weight, layer.bias) for lb in tensor.lazydata.lbs]
  weight, bias = values((3, 4)), values((3,))
  load_state_dict(layer, {"weight": Tensor(weight), "bias": Tensor(bias)})   # written into those buffers
  assert layer.weight.lazydata.axis == 0 and layer.bias.lazydata.axis is None
  assert [lb.base.realized for tensor in (layer.weight, layer.bias) for lb in tensor.lazydata.lbs] == buffers
  np.testing.assert_array_equal(layer.weight.numpy(), weight)
  np.testing.assert_array_equal(Tensor(layer.weight.lazydata.lbs[1]).numpy(), weight[2:])   # the second device's rows
  for replica in layer.bias.lazydata.lbs: np.testing.assert_array_equal(Tensor(replica).numpy(), bias)
  # a sharded value cut another way
  lazy_layer = _sharded_linear()
  load_state_dict(lazy_layer, {"weight": Tensor(weight).shard(D2, 1), "bias": Tensor(bias).shard(D2, 0)})
  np.testing.assert_array_equal(lazy_layer.weight.numpy(), weight)
  np.testing.assert_array_equal(lazy_layer.bias.numpy(), bias)
  assert lazy_layer.weight.lazydata.axis == 0


@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "adamw"])
def test_optimizer_over_sharded_parameters_matches_torch(name):
  import torch
  w, b = values((5, 4)), values((4,))
  make = {"sgd_momentum": (lambda p: SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
          "adam": (lambda p: Adam(p, lr=0.05), lambda p: torch.optim.Adam(p, lr=0.05)),
          "adamw": (lambda p: AdamW(p, lr=0.05, weight_decay=0.1),
                    lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1))}[name]
  weight = Tensor(w, requires_grad=True).shard_(D2, 0)   # rows over the devices; still lazy
  bias = Tensor(b, requires_grad=True).shard_(D2)        # replicated
  torch_weight, torch_bias = torch.tensor(w, requires_grad=True), torch.tensor(b, requires_grad=True)
  optimizer, torch_optimizer = make[0]([weight, bias]), make[1]([torch_weight, torch_bias])
  optimizer.lr = optimizer.lr / 2   # the learning rate is written into every device's copy
  for group in torch_optimizer.param_groups: group["lr"] /= 2
  for step in range(3):
    x = values((5, 4))
    optimizer.zero_grad()
    ((weight * Tensor(x).shard(D2, 0) + bias) ** 2).sum().backward()
    optimizer.step()
    torch_optimizer.zero_grad()
    ((torch_weight * torch.tensor(x) + torch_bias) ** 2).sum().backward()
    torch_optimizer.step()
    assert weight.lazydata.axis == 0 and bias.lazydata.axis is None
    np.testing.assert_allclose(weight.numpy(), torch_weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    for replica in bias.lazydata.lbs:
      np.testing.assert_allclose(Tensor(replica).numpy(), torch_bias.detach().numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- data parallel

class MLP:
  def __init__(self): self.l1, self.l2 = Linear(6, 8), Linear(8, 3)
  def __call__(self, x): return self.l2(self.l1(x).relu())


def mse(model, x, y): return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("make_optimizer", [lambda p: SGD(p, lr=0.1, momentum=0.9), lambda p: Adam(p, lr=0.01)],
                         ids=["sgd", "adam"])
def test_data_parallel_step_equals_whole_batch_step(make_optimizer):
  batches = [(values((7, 6)), values((7, 3))) for _ in range(3)]  # 7 rows: pieces of 4 and 3
  Tensor.manual_seed(3)
  parallel = DataParallel(MLP, D2, make_optimizer, bucket_bytes=64)  # small buckets: several allreduces
  Tensor.manual_seed(3)
  single = DataParallel(MLP, ("CLANG",), make_optimizer)
  for x, y in batches:
    np.testing.assert_allclose(parallel.step(mse, x, y).item(), single.step(mse, x, y).item(), rtol=1e-5)
  reference = get_state_dict(single.model)
  for replica in parallel.replicas:
    for name, tensor in get_state_dict(replica).items():
      np.testing.assert_allclose(tensor.numpy(), reference[name].numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
  assert [t.device for t in get_state_dict(parallel.replicas[1]).values()] == ["CLANG:1"] * 4


def test_grad_buckets_group_by_size_and_dtype_last_first():
  params = [Tensor.zeros(4), Tensor.zeros(4), Tensor.zeros(100), Tensor.zeros(4, dtype=dtypes.float16), Tensor.zeros(4)]
  assert grad_buckets(params, bucket_bytes=32) == [[4], [3], [2], [1, 0]]


def test_process_group_of_one_keeps_gradients(monkeypatch):
  from ourgrad.distributed.data_parallel import allreduce_gradients_across_processes
  from ourgrad.distributed.nccl_collectives import ProcessGroup
  monkeypatch.setenv("WORLD_SIZE", "1")
  model = MLP()
  params = list(get_state_dict(model).values())
  mse(model, Tensor(values((4, 6))), Tensor(values((4, 3)))).backward()
  before = [param.grad.numpy() for param in params]
  allreduce_gradients_across_processes(params, ProcessGroup(), bucket_bytes=100)
  for param, grad in zip(params, before): np.testing.assert_array_equal(param.grad.numpy(), grad)


def test_save_only_from_rank_zero(tmp_path, monkeypatch):
  parallel = DataParallel(MLP, D2, lambda p: SGD(p, lr=0.1))
  monkeypatch.setenv("RANK", "1")
  assert not parallel.save(str(tmp_path / "a.safetensors")) and not (tmp_path / "a.safetensors").exists()
  monkeypatch.setenv("RANK", "0")
  assert parallel.save(str(tmp_path / "a.safetensors")) and (tmp_path / "a.safetensors").exists()


# ---------------------------------------------------------------- NCCL

def _nccl_or_skip():
  from ourgrad.distributed import nccl
  try:
    nccl.load()
  except Exception as error:
    pytest.skip(f"no NCCL library: {error}")
  return nccl


def test_nccl_library_answers_without_gpus(monkeypatch):
  monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
  nccl = _nccl_or_skip()
  assert nccl.version() >= 20000
  shared_id = nccl.unique_id()
  raw = nccl.id_to_bytes(shared_id)
  assert len(raw) == nccl.UNIQUE_ID_BYTES and nccl.id_to_bytes(nccl.id_from_bytes(raw)) == raw
  assert os.environ.get("NCCL_NVLS_ENABLE", "0") == "0"


def test_unique_id_file_roundtrip(tmp_path):
  """Rank 0 writes the id file, another rank reads the same 128 bytes (ids hold zero bytes: not a C string)."""
  from ourgrad.distributed import nccl
  from ourgrad.distributed.nccl_collectives import read_or_create_unique_id
  raw = bytes(range(100)) + bytes(28)
  path = tmp_path / "nccl_id"
  path.write_bytes(raw)
  assert nccl.id_to_bytes(read_or_create_unique_id(str(path), rank=1, timeout_s=1)) == raw
  with pytest.raises(TimeoutError): read_or_create_unique_id(str(tmp_path / "missing"), rank=1, timeout_s=0.1)


def _cuda_gpus() -> int:
  try:
    from cuda.bindings import driver
    driver.cuInit(0)
    error, count = driver.cuDeviceGetCount()
    return count if int(error) == 0 else 0
  except Exception:
    return 0


@pytest.mark.skipif(_cuda_gpus() < 2, reason="needs two CUDA GPUs")
def test_nccl_collectives_on_two_gpus():
  _nccl_or_skip()
  gpus = ("CUDA:0", "CUDA:1")
  arrays = [values((1000, 3)) for _ in gpus]
  lazies = per_device(arrays, gpus)
  assert collectives.uses_nccl(lazies)
  for result in read(collectives.allreduce(lazies)): np.testing.assert_allclose(result, arrays[0] + arrays[1], 1e-6)
  for result in read(collectives.allgather(lazies)): np.testing.assert_array_equal(result, np.concatenate(arrays))
  for result in read(collectives.broadcast(lazies, 1)): np.testing.assert_array_equal(result, arrays[1])
  pieces = np.split(arrays[0] + arrays[1], 2)
  for result, piece in zip(read(collectives.reduce_scatter(lazies)), pieces): np.testing.assert_allclose(result, piece,
                                                                                                          1e-6)


# ---------------------------------------------------------------- launcher

def test_launcher_gives_each_process_its_rank(tmp_path):
  import subprocess
  import sys
  script = tmp_path / "report.py"
  script.write_text("import os, sys\n"
                    "out = os.path.join(sys.argv[1], 'rank' + os.environ['RANK'])\n"
                    "open(out, 'w').write(','.join(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK')) + "
                    "'|' + os.path.basename(os.environ['OURGRAD_NCCL_ID_FILE']))\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  environment = dict(os.environ, PYTHONPATH=root)
  result = subprocess.run([sys.executable, "-m", "ourgrad.distributed.launch", "--nproc", "3", str(script),
                           str(tmp_path)], env=environment, cwd=root, timeout=60)
  assert result.returncode == 0
  assert sorted((tmp_path / f"rank{rank}").read_text() for rank in range(3)) == \
    [f"{rank},3,{rank}|nccl_id" for rank in range(3)]


def test_launcher_returns_the_failing_exit_code(tmp_path):
  from ourgrad.distributed.launch import main
  script = tmp_path / "fail.py"
  script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
  assert main(["--nproc", "2", str(script)]) == 3


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_training_on_a_batch_sharded_input_matches_torch(momentum):
  """BatchNorm2d in training on input sharded along the batch: output, input/weight/bias gradients and running
  statistics (its statistics, normalization and backward are built on lazy buffers, MultiLazyBuffers here)."""
  import torch
  from ourgrad import nn
  rng = np.random.default_rng(3)
  x_np = (rng.standard_normal((4, 3, 5, 5)) * 2 + 1).astype(np.float32)
  upstream = rng.standard_normal((4, 3, 5, 5)).astype(np.float32)
  ours = nn.BatchNorm2d(3, momentum=momentum)
  for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
    getattr(ours, name).shard_(D2).realize()
  theirs = torch.nn.BatchNorm2d(3, momentum=momentum)
  for step in range(2):
    x = Tensor(x_np + step, requires_grad=True)
    x_sharded = x.shard(D2, axis=0)
    with Tensor.train():
      out = ours(x_sharded)
      (out * Tensor(upstream).shard(D2, axis=0)).sum().backward()
    reference_x = torch.tensor(x_np + step, requires_grad=True)
    reference = theirs(reference_x)
    (reference * torch.tensor(upstream)).sum().backward()
    np.testing.assert_allclose(out.to("CLANG:0").numpy(), reference.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(x.grad.numpy(), reference_x.grad.numpy(), rtol=1e-4, atol=1e-4)
    for name in ("running_mean", "running_var"):
      np.testing.assert_allclose(getattr(ours, name).to("CLANG:0").numpy(), getattr(theirs, name).numpy(),
                                 rtol=1e-5, atol=1e-6, err_msg=name)
  for name in ("weight", "bias"):
    np.testing.assert_allclose(getattr(ours, name).grad.to("CLANG:0").numpy(),
                               getattr(theirs, name).grad.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)
