"""The towers' fp32 convolutions run in full fp32 on CUDA (models/fp32_conv.py): cuDNN's default TF32 would round
them to ~1e-3. What a CPU can check: which inputs open the scope, what the scope sets and restores, and that every
convolution of the audio tower and of SigLIP's patch embedding runs inside it. That cuDNN then computes in fp32 needs
a GPU to see."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gemmaserve.models import fp32_conv
from gemmaserve.models.gemma4_audio import AudioTower, AudioTowerConfig
from gemmaserve.models.siglip import SiglipConfig, SiglipEmbeddings


def _conv_precisions(module: nn.Module) -> list[str]:
    """cuDNN's convolution precision as each of the module's convolutions is called (filled as it runs)."""
    seen: list[str] = []
    for m in module.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d)):
            m.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cudnn.conv.fp32_precision))
    return seen


def test_fp32_convolutions_on_cuda_run_in_full_fp32(monkeypatch):
    conv = torch.backends.cudnn.conv
    before = conv.fp32_precision
    cuda = torch.device("cuda")
    assert fp32_conv.tf32_would_apply(SimpleNamespace(dtype=torch.float32, device=cuda))
    assert not fp32_conv.tf32_would_apply(SimpleNamespace(dtype=torch.bfloat16, device=cuda))
    assert not fp32_conv.tf32_would_apply(torch.zeros(1))
    with fp32_conv.exact_fp32_convs(torch.zeros(1)):   # CPU: untouched
        assert conv.fp32_precision == before

    # every tensor taken for a CUDA one: the towers' convolutions in fp32 run in the scope, bf16 ones do not
    monkeypatch.setattr(fp32_conv, "tf32_would_apply", lambda x: x.dtype == torch.float32)
    with pytest.raises(RuntimeError, match="inside"), fp32_conv.exact_fp32_convs(torch.zeros(1)):
        assert conv.fp32_precision == "ieee"
        raise RuntimeError("inside")
    assert conv.fp32_precision == before
    cfg = AudioTowerConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           subsampling_conv_channels=(8, 4), output_proj_dims=8)
    siglip = SiglipConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          image_size=28, patch_size=14)
    for dtype, want in ((torch.float32, "ieee"), (torch.bfloat16, before)):
        tower = AudioTower(cfg).to(dtype)
        embeddings = SiglipEmbeddings(siglip, dtype)
        seen, seen_siglip = _conv_precisions(tower), _conv_precisions(embeddings)
        with torch.no_grad():
            tower(torch.randn(40, 128, dtype=dtype), torch.ones(40, dtype=torch.bool))
            embeddings(torch.randn(2, 3, 28, 28))
        assert seen == [want] * 4 and seen_siglip == [want], (dtype, seen, seen_siglip)   # 2 subsampling, 2 depthwise
        assert conv.fp32_precision == before
