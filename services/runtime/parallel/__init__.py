"""Tensor parallelism: one model spread over several ranks (processes) with torch.distributed.

shard.py says which heads and MLP columns each rank owns and slices a checkpoint to them;
collectives.py is the process groups (gloo on a CPU, NCCL on CUDA for the all-reduce) and the
step inputs rank 0 broadcasts; leader.py is rank 0's side (start the other ranks, watch them);
worker.py the other ranks' process and its loop.
"""
