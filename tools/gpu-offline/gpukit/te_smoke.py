"""Smoke-test Transformer Engine's PyTorch side on the GPU: versions, a bf16 Linear and an attention forward+backward.

Run by ``tools/gpu-offline/gpu_megakit.sh build`` after the kit is installed. It checks the sm_90-trimmed core library
(tools/gpu-offline/gpukit/wheel_trim.py) and the locally built extension together: a kernel missing from the trimmed library
fails here, not inside a NeMo RL worker. Exit 0: all passed; 1: Linear failed; 2: attention failed with the
current NVTE_* settings (the caller retries with the fallbacks).
"""

from __future__ import annotations

import os
import sys

import torch


def _linear() -> None:
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    layer = te.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().mean().backward()
    reference = x.detach() @ layer.weight.detach().t() + layer.bias.detach()
    error = (y.detach() - reference).abs().max().item()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all()), (
        "te.Linear backward gave no finite gradient"
    )
    assert error < 0.1, f"te.Linear differs from x @ W.T + b by {error}"
    print(f"te.Linear bf16 forward+backward OK (max |error| {error:.4f})")


def _attention() -> None:
    import transformer_engine.pytorch as te

    heads, dim, seq, batch = 4, 64, 128, 2
    attention = te.DotProductAttention(heads, dim, attn_mask_type="causal", qkv_format="sbhd")
    q, k, v = (
        torch.randn(seq, batch, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    out = attention(q, k, v)
    out.float().sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all()), (
        "attention backward gave no finite gradient"
    )
    print(
        f"te.DotProductAttention bf16 causal forward+backward OK ({_picked_backend()}; NVTE_DEBUG=1 logs the pick)"
    )


def _picked_backend() -> str:
    flags = {name: os.environ.get(name, "default") for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN")}
    return ", ".join(f"{k}={v}" for k, v in flags.items())


def main() -> int:
    import transformer_engine
    import transformer_engine.pytorch as te

    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name()}, "
        f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    )
    with open("/proc/self/maps") as maps:
        cudnn = sorted({line.split()[-1] for line in maps if "libcudnn" in line})
    print(f"cuDNN libraries loaded: {cudnn}")
    print(
        f"transformer_engine {transformer_engine.__version__}; cuDNN: torch {torch.backends.cudnn.version()}, "
        f"TE {te.get_cudnn_version()} (NeMo RL pins nvidia-cudnn-cu13 9.20.0.48)"
    )
    try:
        _linear()
    except Exception as exc:
        print(f"FAIL te.Linear: {type(exc).__name__}: {exc}")
        return 1
    try:
        _attention()
    except Exception as exc:
        print(f"FAIL te.DotProductAttention with {_picked_backend()}: {type(exc).__name__}: {str(exc)[:300]}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
