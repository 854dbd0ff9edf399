import os
import tempfile

# Two torch threads on two busy cores can be 10x slower than one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Keep the suite's tokenizer files and weight fingerprints out of the user's cache.
os.environ["DIFFPIPE_CACHE"] = tempfile.mkdtemp(prefix="diffpipe-test-cache-")

import torch  # noqa: E402

torch.set_num_threads(1)
