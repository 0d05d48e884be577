"""Start one process per GPU: `python -m ourgrad.distributed.launch --nproc N script.py args...`.

Each process gets RANK, WORLD_SIZE and LOCAL_RANK (the GPU it drives on this host) in its environment, and
OURGRAD_NCCL_ID_FILE: the file in a fresh temporary folder where rank 0 writes the NCCL unique id and the other ranks
read it (ourgrad.distributed.nccl_collectives.ProcessGroup). Several hosts: start the launcher on each host with
--nnodes, --node-rank and an --id-file on a filesystem every host sees (see docs/distributed.md). The launcher waits
for every process; if one fails, it stops the others and exits with the first failure's code.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m ourgrad.distributed.launch", description=__doc__.split("\n")[0])
  parser.add_argument("--nproc", type=int, required=True, help="processes on this host (one per GPU)")
  parser.add_argument("--nnodes", type=int, default=1, help="hosts taking part (each runs this launcher)")
  parser.add_argument("--node-rank", type=int, default=0, help="this host's index among --nnodes")
  parser.add_argument("--id-file", help="where rank 0 writes the NCCL id (default: a new temporary folder; with "
                      "several hosts, a path on a shared filesystem)")
  parser.add_argument("script", help="the Python script each process runs")
  parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
  args = parser.parse_args(argv)
  if args.nproc < 1: parser.error("--nproc must be at least 1")
  if args.nnodes > 1 and not args.id_file: parser.error("several hosts need --id-file on a shared filesystem")
  return args


def process_environments(nproc: int, id_file: str, nnodes: int = 1, node_rank: int = 0) -> list[dict[str, str]]:
  """The environment of each process started on this host."""
  world_size = nproc * nnodes
  environments = []
  for local_rank in range(nproc):
    environment = dict(os.environ)
    environment.update(RANK=str(node_rank * nproc + local_rank), WORLD_SIZE=str(world_size),
                       LOCAL_RANK=str(local_rank), OURGRAD_NCCL_ID_FILE=id_file)
    environment.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast unless asked (see nccl.py)
    environments.append(environment)
  return environments


def run(args: argparse.Namespace) -> int:
  """Start the processes and wait for them; the exit code of the first that failed, else 0."""
  with tempfile.TemporaryDirectory(prefix="ourgrad_launch_") as folder:
    id_file = args.id_file or os.path.join(folder, "nccl_id")
    if args.node_rank == 0 and os.path.exists(id_file): os.unlink(id_file)  # never hand out a stale id
    command = [sys.executable, args.script, *args.script_args]
    processes = [subprocess.Popen(command, env=environment)
                 for environment in process_environments(args.nproc, id_file, args.nnodes, args.node_rank)]
    failed = 0
    while any(process.poll() is None for process in processes):
      failed = next((process.returncode for process in processes if process.returncode not in (None, 0)), 0)
      if failed: break
      time.sleep(0.1)
    if failed:
      for process in processes:
        if process.poll() is None: process.terminate()
    for process in processes: process.wait()
    return failed or next((process.returncode for process in processes if process.returncode), 0)


def main(argv: list[str] | None = None) -> int:
  return run(parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
