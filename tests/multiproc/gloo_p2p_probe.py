"""Run by ``test_gloo_p2p.py`` under torchrun (2 ranks, gloo): one batch of three P2P ops, rank 0 -> rank 1.

``keep``: through ``ppbackward._tools.harness.gloo_p2p`` (every ``Work`` kept and waited on); ``pop``: torch
2.5-2.7's ``_batch_p2p`` (only the last ``Work`` kept), the negative control, which must time out.
Prints ``rank <r> received [...]`` and ``rank <r> done``.
"""

import gc
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ppbackward._tools.harness import gloo_p2p

# A long timeout for the rendezvous (start-up can be slow on a busy machine), then a group whose timeout
# is argv[2] seconds for the batch itself, made once both ranks are known to be up.
dist.init_process_group("gloo", timeout=timedelta(seconds=300))
dist.barrier()
group = dist.new_group(backend="gloo", timeout=timedelta(seconds=float(sys.argv[2])))
rank = dist.get_rank()
if rank == 0:
    buffers = [torch.full((4,), float(i)) for i in range(3)]
    ops = [dist.P2POp(dist.isend, b, 1, group) for b in buffers]
else:
    buffers = [torch.zeros(4) for _ in range(3)]
    ops = [dist.P2POp(dist.irecv, b, 0, group) for b in buffers]
if sys.argv[1] == "keep":
    gloo_p2p._batch_p2p_keeping_all(ops).wait()
else:
    dist.batch_isend_irecv(ops).pop().wait()
del ops
gc.collect()
print(f"rank {rank} received {[float(b[0]) for b in buffers]}", flush=True)
dist.barrier()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
