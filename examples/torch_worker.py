"""Your own PyTorch training script on a psdk cluster: the README's example.

Make the job's keys, start the ps, then one process per worker (the chief is task 0):

    python -m psdk keys keys_dir=keys workers=2
    python -m psdk ps ps_hosts=127.0.0.1:2222 worker_hosts=localhost,localhost transport.keys_dir=keys &
    python examples/torch_worker.py 0 127.0.0.1:2222 keys &
    python examples/torch_worker.py 1 127.0.0.1:2222 keys
"""

import sys

import torch
import torch.nn.functional as F

import psdk
from psdk.data import mnist

task, ps_hosts, keys = int(sys.argv[1]), sys.argv[2], sys.argv[3]
cluster = psdk.ClusterSpec({"ps": ps_hosts, "worker": ["localhost", "localhost"]})
data = mnist.split(mnist.load(mnist.resolve_dir(None)), task, num_workers=2)  # PSDK_DATA_DIR or a download
x, y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)

torch.set_num_threads(1)  # two workers and a ps share this machine's cores
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
with psdk.connect(cluster, task_index=task, steps=1000, sync="sync", keys=keys) as session:
    opt = psdk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, session)
    opt.broadcast_parameters()  # the chief's initial weights go to the ps; the others take them
    while not session.should_stop():
        batch = torch.randint(len(x), (100,))
        opt.zero_grad()
        F.cross_entropy(model(x[batch]), y[batch]).backward()
        opt.step()  # push the gradients, pull the new weights
    session.finish()  # the chief waits here for the other workers
    if session.is_chief:
        opt.pull()
        accuracy = (model(torch.from_numpy(data.test_x)).argmax(1) == torch.from_numpy(data.test_y)).float()
        print(f"global step {session.global_step}, test accuracy {accuracy.mean():.4f}")
