"""Whether the GPU tier can run here: ``python tests/gpu/gpus.py`` prints what it found and
exits 0 when torch sees a CUDA device, else prints why not and exits 1 (``make test-gpu``
reads it; tests/gpu/conftest.py skips with the same reason)."""

from __future__ import annotations

import sys


def why_not() -> str | None:
    """None when torch is built with CUDA and sees a device, else the reason and the fix."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the venv always has torch
        return f"torch is not importable ({e})"
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is not built with CUDA (torch.version.cuda is None): "
            "make a GPU venv, make venv VENV=.venv-gpu TORCH_SPEC=torch TORCH_INDEX= "
            "EXTRAS=gpu,dev, and run make test-gpu VENV=.venv-gpu"
        )
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return (
            f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none "
            "(driver missing, or CUDA_VISIBLE_DEVICES hides every GPU)"
        )
    return None


def count() -> int:
    import torch

    return torch.cuda.device_count()


def found() -> str:
    import torch

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} CUDA device(s): {', '.join(names)}; torch {torch.__version__}"


if __name__ == "__main__":
    why = why_not()
    print(why if why is not None else found())
    sys.exit(0 if why is None else 1)
