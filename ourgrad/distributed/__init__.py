"""Work over several devices: collectives (collectives.py), the NCCL binding (nccl.py), data-parallel training
(data_parallel.py) and a launcher for one process per GPU (launch.py). docs/distributed.md is the guide."""
