"""A module the worker server imports in a test: it says so in a file, then takes its time."""

import os
import time
from pathlib import Path

Path(os.environ["DDPKIT_TEST_SERVER_IMPORTING"]).write_text(str(os.getpid()))
time.sleep(5.0)
