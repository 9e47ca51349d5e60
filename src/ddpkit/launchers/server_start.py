"""The worker server's first import, and its only purpose: prepare the server before it imports torch.

multiprocessing's forkserver runs no code of ours but the imports of its
preload list (:data:`ddpkit.launchers.server.WORKER_PRELOAD`), of which this
module is the first. Imported anywhere else (the variable unset), it does
nothing.
"""

import os

from ddpkit.launchers.worker_env import SERVER_VARIABLE, prepare_server

if (_launcher := os.environ.get(SERVER_VARIABLE, "")).isdigit():
    prepare_server(int(_launcher))
