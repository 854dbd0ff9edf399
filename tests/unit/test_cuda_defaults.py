"""The CUDA defaults every model-running stage applies (models._common.cuda_defaults).

No GPU here: ``torch.cuda.is_available`` is the one thing replaced; the flags are PyTorch's own, read back
through its own accessors, and restored after each test.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffpipe.models._common import cuda_defaults


@pytest.fixture
def flags():
    saved = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.enable_cudnn_sdp(saved[0])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]


def test_on_cuda_sdpa_keeps_off_cudnn_and_tf32_is_on(flags, monkeypatch):
    torch.backends.cuda.enable_cudnn_sdp(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda_defaults()
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    # attention_backend: _native_cudnn (diffusers' sdpa_kernel context) still reaches cuDNN when asked.
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert torch.backends.cuda.cudnn_sdp_enabled()
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_on_the_cpu_nothing_changes(flags, monkeypatch):
    torch.backends.cuda.enable_cudnn_sdp(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda_defaults()
    assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.matmul.allow_tf32
