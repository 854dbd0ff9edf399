"""diffpipe: a Snakemake-first toolkit for fine-tuning diffusion models."""

import logging as _logging
import os as _os

__version__ = "0.1.0"

#: polars' allocator (jemalloc) keeps freed pages for 10 s by default. Validation and the plan free a
#: chunk's columns, dicts and Arrow copies as they go, so at a million items those kept pages were a
#: third of validation's resident memory; returned at once, the process holds what its tables need.
#: Set before anything imports polars (jemalloc reads it when it starts); a user's own setting stays.
POLARS_MALLOC_CONF = "dirty_decay_ms:0,muzzy_decay_ms:0"
_os.environ.setdefault("_RJEM_MALLOC_CONF", POLARS_MALLOC_CONF)

# diffusers imports torchao whenever it is installed (it is, for `train.base_weights: int8`), and that
# import warns, on every diffpipe command: torchao that its optional CUDA kernels do not load with this
# torch build, torch's pytree about two enums torchao registers, diffusers that some torchao tensor types
# it would allow in pickled checkpoints are gone. diffpipe uses none of them (int8 weight-only runs on
# torch's own int8 matmul; weights load through safetensors), so these loggers keep to errors.
for _name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
