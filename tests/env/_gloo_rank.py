"""One rank of the cross-namespace gloo test: resolve the environment, all_reduce, print JSON.

Run as a script inside a namespace with torchrun-style variables set; with
argument "auto" it applies gloo_interface_environ first, with "none" it
leaves gloo to pick its own address.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from ddpkit.env.detect import detect_environment
from ddpkit.env.network import gloo_interface_environ

env = detect_environment(os.environ)
if sys.argv[1] == "auto":
    os.environ.update(gloo_interface_environ(os.environ, env.master_addr))
dist.init_process_group(
    "gloo",
    init_method=f"tcp://{env.master_addr}:{env.master_port}",
    rank=env.rank,
    world_size=env.world_size,
    timeout=datetime.timedelta(seconds=float(sys.argv[2])),
)
value = torch.tensor([env.rank + 1.0])
dist.all_reduce(value)
dist.destroy_process_group()
print(json.dumps({"rank": env.rank, "sum": value.item(), "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}))
