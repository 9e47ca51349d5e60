"""A run refused at once, as a second run into a live run's output_dir is: each rank exits with status 2."""

import sys

print("refused: this folder is another run's; choose another output_dir", file=sys.stderr, flush=True)
sys.exit(2)
